"""kvsidecar as SGLang's HiCache L3 backend, driven through SGLang's own
classes: `StorageBackendFactory` makes it from the dynamic config, SGLang's
host pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`, built on the
CPU) hold the pages, and SGLang's chain hashes key them. Pages saved by
this process are loaded byte for byte by another engine process through a
real sidecar.

Skipped where SGLang is not importable (CI installs none); run it with
`python -m sideenv run sglang -- python -m pytest tests/test_sglang_storage.py`.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed here (docs/engines.md)"
)

import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang_helpers import (
    backend,
    fill,
    host_pool,
    info,
    load_elsewhere,
    page_keys,
    pages_of,
    storage_config,
)
from sidecar_proc import SPAWN, Sidecar, wait_for

from engine_shim.sglang_storage import KVSidecarStorage

LAYOUTS = [
    ("mha", "layer_first", 4),
    ("mha", "page_first", 8),
    ("mha", "page_first_direct", 4),
    ("mha", "page_head", 2),
    ("mla", "layer_first", 4),
    ("mla", "page_first", 2),
    ("mla", "page_first_direct", 8),
]


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    s = Sidecar(capacity="64MiB").start()
    try:
        yield s
        assert s.stop() == 0
    finally:
        s.cleanup()


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    """Another engine process, kept for the module (SGLang imports in seconds)."""
    with SPAWN.Pool(1) as pool:
        yield pool


def test_the_factory_makes_it_from_the_dynamic_config(sidecar: Sidecar) -> None:
    pool = host_pool()
    store = backend(pool, sidecar.endpoint)
    try:
        assert isinstance(store, KVSidecarStorage)
        assert store.geometry is not None and store.geometry.num_pages == pool.page_num
        assert store.batch_exists(page_keys(0, 3, pool.page_size), info([])) == 0
    finally:
        store.close()


@pytest.mark.parametrize(("kind", "layout", "page_size"), LAYOUTS)
@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_pages_saved_here_load_byte_exact_in_another_process(
    sidecar: Sidecar, engine: object, kind: str, layout: str, page_size: int, v2: bool
) -> None:
    pool = host_pool(kind, layout, page_size)
    store = backend(pool, sidecar.endpoint)
    keys = page_keys(hash((kind, layout, v2)) % 1000, 6, page_size)
    where = pool.alloc(6 * page_size)
    fill(pool, where, seed=1)
    first, second = where[: 2 * page_size], where[2 * page_size :]
    try:
        if v2:
            put = [PoolTransfer(name=PoolName.KV, host_indices=first, keys=keys[:2])]
            assert store.batch_set_v2(put, info([])) == {PoolName.KV: [True, True]}
            put = [PoolTransfer(name=PoolName.KV, host_indices=second, keys=keys[2:])]
            assert store.batch_set_v2(put, info(keys[:2])) == {PoolName.KV: [True] * 4}
        else:
            assert store.batch_set_v1(keys[:2], first, info([])) == [True, True]
            assert store.batch_set_v1(keys[2:], second, info(keys[:2])) == [True] * 4
        expected = pages_of(pool, where)
    finally:
        store.close()
    found, got, loaded = engine.apply(  # type: ignore[attr-defined]
        load_elsewhere, (sidecar.endpoint, kind, layout, page_size, keys, 5, v2)
    )
    assert found == 6 and got == [True] * 6
    assert loaded == expected


def test_sglangs_own_prefetch_query_from_the_first_page_hits(sidecar: Sidecar) -> None:
    """SGLang's HybridCacheController (its radix cache's, for every model)
    asks a request whose host match is empty with prefix_keys None, not []:
    that is the first page, and its hits count (before, it was read as
    "SGLang not told to pass them" and missed)."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.utils import get_hash_str

    pool = host_pool(page_size=4)
    store = backend(pool, sidecar.endpoint)
    ids = list(range(5000, 5040))
    keys = list(get_hash_str(ids, None, page_size=4))
    where = pool.alloc(40)
    fill(pool, where, seed=5)
    try:
        assert store.batch_set_v1(keys, where, info([])) == [True] * 10
        controller = SimpleNamespace(storage_backend=store, page_size=4)
        operation = SimpleNamespace(
            token_ids=ids,
            last_hash=None,
            prefix_keys=[],
            assume_stored=False,
            pool_transfers=None,
            pool_storage_result=PoolTransferResult(0, {}),
        )
        hashes, hit_tokens = HybridCacheController._storage_hit_query(controller, operation)
        assert (len(hashes), hit_tokens) == (10, 40)
    finally:
        store.close()


def test_exists_is_the_longest_prefix_and_a_set_needs_its_prefix(sidecar: Sidecar) -> None:
    pool = host_pool(page_size=4)
    store = backend(pool, sidecar.endpoint)
    keys = page_keys(7, 10, 4)
    where = pool.alloc(10 * 4)
    fill(pool, where, seed=2)
    try:
        # Pages 4.. without pages 0..3 in the sidecar: nothing is stored.
        assert store.batch_set_v1(keys[4:6], where[16:24], info(keys[:4])) == [False, False]
        assert store.batch_set_v1(keys[:6], where[:24], info([])) == [True] * 6
        assert store.batch_exists(keys, info([])) == 6
        assert store.batch_exists(keys[2:], info(keys[:2])) == 4
        assert store.batch_exists(keys[6:], info(keys[:6])) == 0
        assert store.batch_exists(keys[3:], info(keys[:2] + keys[4:5])) == 0  # another chain
        result = store.batch_exists_v2(keys, None, info([]))
        assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (6, {PoolName.KV: 6})
        # A pool it does not store (a hybrid model's Mamba states): nothing restores.
        mamba = [PoolTransfer(name=PoolName.MAMBA, keys=keys[:1])]
        assert store.batch_exists_v2(keys, mamba, info([])).kv_hit_pages == 0
        # Loading past what is stored: the leading pages only.
        got = store.batch_get_v1(keys[4:8], where[16:32], info(keys[:4]))
        assert got == [True, True, False, False]
        # Without prefix_keys a read starts at the first page (SGLang's
        # prefetch passes None for an empty prefix); a set is refused (SGLang
        # was not told to pass them: its backups pass [] from the first page).
        assert store.batch_exists(keys, None) == 6
        assert store.batch_exists(keys[2:], None) == 0  # keyed from the first page: a miss
        assert store.batch_get_v1(keys[:2], where[32:40], None) == [True, True]
        assert store.batch_set_v1(keys[:1], where[:4], None) == [False]
        metrics = store.get_stats()
        assert metrics.backup_pgs == [6] and metrics.prefetch_pgs == [2, 2]
        assert store.get_stats().backup_pgs == []
    finally:
        store.close()


def test_mha_ranks_keep_their_own_shards_and_mla_ranks_share_one(sidecar: Sidecar) -> None:
    keys = page_keys(11, 3, 4)
    stores = []
    try:
        for kind in ("mha", "mla"):
            rank0, rank1 = host_pool(kind), host_pool(kind)
            where = rank0.alloc(12)
            fill(rank0, where, seed=3)
            s0 = backend(rank0, sidecar.endpoint, tp_rank=0, tp_size=2)
            s1 = backend(rank1, sidecar.endpoint, tp_rank=1, tp_size=2)
            stores += [s0, s1]
            assert s0.batch_set_v1(keys, where, info([])) == [True] * 3
            if kind == "mha":  # rank 1's shard is missing: a miss (SGLang MIN-reduces it)
                assert s1.batch_exists(keys, info([])) == 0
                assert s1.batch_get_v1(keys, rank1.alloc(12), info([])) == [False] * 3
            else:  # one copy, written by rank 0, read by every rank
                assert s1.batch_exists(keys, info([])) == 3
                there = rank1.alloc(12)
                assert s1.batch_get_v1(keys, there, info([])) == [True] * 3
                assert pages_of(rank1, there) == pages_of(rank0, where)
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"model_revision": None}, "model_revision"),
        ({"interface_v1": 0}, "interface_v1"),
        ({"timeout": "1s"}, "timeout"),
        ({"endpoint": "http://x"}, "endpoint"),
        ({"model_revison": "r2"}, "model_revison"),
    ],
)
def test_a_bad_extra_config_is_a_clear_error_at_start(extra: dict, named: str) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = dict(extra)
    config = storage_config(extra.pop("endpoint", "ipc:///nonexistent.sock"), **extra)
    with pytest.raises(ValueError, match=named):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_a_sidecar_killed_mid_run_costs_misses_never_an_exception() -> None:
    """An engine thread saves, looks up and loads in a loop while the
    sidecar is SIGKILLed and started again: every call returns (misses and
    failed sets once its table is stale), and the backend finds the new one."""
    s = Sidecar(capacity="16MiB").start()
    pool = host_pool(page_size=4)
    store = backend(pool, s.endpoint, timeout=2.0)
    keys, where, back = page_keys(13, 4, 4), pool.alloc(16), pool.alloc(16)
    fill(pool, where, seed=4)
    rounds: list[bool] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            try:
                saved = store.batch_set_v1(keys, where, info([]))
                found = store.batch_exists(keys, info([]))
                got = store.batch_get_v1(keys, back, info([]))
            except BaseException as err:  # what the contract forbids
                errors.append(err)
                return
            rounds.append(saved == got == [True] * 4 and found == 4)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        wait_for(lambda: sum(rounds) >= 3 or bool(errors))
        assert s.proc is not None
        s.proc.kill()
        s.proc.wait()
        killed = len(rounds) + 1  # the round under way may have finished first
        # Its hot index serves intact CPU hits until its stamp is older than
        # the timeout (docs/sidecar.md, "The hot path"); from then on, misses.
        wait_for(lambda: False in rounds[killed:] or bool(errors))
        missed = killed + rounds[killed:].index(False)
        wait_for(lambda: len(rounds) >= missed + 3 or bool(errors))
        assert not any(rounds[missed:])
        s.start()  # the same instance again
        wait_for(lambda: (bool(rounds) and rounds[-1]) or bool(errors))
    finally:
        stop.set()
        thread.join()
        store.close()
        s.stop()
        s.cleanup()
    assert errors == []
    assert pages_of(pool, back) == pages_of(pool, where)


def test_a_stalled_sidecar_costs_one_timeout_per_call() -> None:
    s = Sidecar(capacity="16MiB").start()
    pool = host_pool(page_size=4)
    store = backend(pool, s.endpoint, timeout=1.0)
    keys, where = page_keys(17, 3, 4), pool.alloc(12)
    try:
        assert store.batch_set_v1(keys[:1], where[:4], info([])) == [True]
        assert s.proc is not None
        s.proc.send_signal(signal.SIGSTOP)
        try:
            # Its CPU hits are served from the hot index until its stamp is
            # older than the timeout; then every call asks it, and times out.
            wait_for(lambda: store.batch_exists(keys, info([])) == 0)
            start = time.monotonic()
            assert store.batch_get_v1(keys[:1], where[:4], info([])) == [False]
            assert store.batch_set_v1(keys[1:], where[4:], info(keys[:1])) == [False, False]
            assert time.monotonic() - start < 2 * 1.0 + 5.0  # not until the sidecar wakes
        finally:
            s.proc.send_signal(signal.SIGCONT)

        # The stalled set's late plan is given back; until then its pages
        # count as in flight, so a set may report them before they are there.
        def stored() -> bool:
            saved = store.batch_set_v1(keys[1:], where[4:], info(keys[:1])) == [True] * 2
            return saved and store.batch_exists(keys, info([])) == 3

        wait_for(stored)
    finally:
        store.close()
        assert s.stop() == 0
        s.cleanup()


def test_clear_drops_this_models_pages(sidecar: Sidecar) -> None:
    pool = host_pool(page_size=4)
    store = backend(pool, sidecar.endpoint, model_revision="to-clear")
    other = backend(host_pool(page_size=4), sidecar.endpoint)
    keys, where = page_keys(19, 2, 4), pool.alloc(8)
    try:
        assert store.batch_set_v1(keys, where, info([])) == [True, True]
        assert other.batch_set_v1(keys, where, info([])) == [True, True]
        assert store.clear() is True
        assert store.batch_exists(keys, info([])) == 0
        assert other.batch_exists(keys, info([])) == 2  # another revision: kept
    finally:
        store.close()
        other.close()


def test_each_calling_thread_has_its_own_client(sidecar: Sidecar) -> None:
    pool = host_pool(page_size=4)
    store = backend(pool, sidecar.endpoint)
    keys = page_keys(23, 8, 4)
    spans = [pool.alloc(4) for _ in range(8)]
    fill(pool, __import__("torch").cat(spans), seed=5)
    assert store.batch_set_v1(keys[:1], spans[0], info([])) == [True]
    results: dict[int, list[bool]] = {}

    def save(i: int) -> None:  # pages 1..7, each under the page before it
        results[i] = store.batch_set_v1(keys[i : i + 1], spans[i], info(keys[:i]))

    try:
        for i in range(1, 8):
            worker = threading.Thread(target=save, args=(i,))
            worker.start()
            worker.join()
        assert results == {i: [True] for i in range(1, 8)}
        assert len(store._clients) == 8  # the registering thread's and one per worker
        assert store.batch_exists(keys, info([])) == 8
    finally:
        store.close()


def test_attached_before_its_sidecar_starts_it_misses_then_serves() -> None:
    s = Sidecar(capacity="16MiB")  # not started yet
    pool = host_pool(page_size=4)
    store = backend(pool, s.endpoint, timeout=1.0)  # no error: registered once it answers
    keys, where = page_keys(29, 2, 4), pool.alloc(8)
    try:
        assert store.batch_exists(keys, info([])) == 0
        assert store.batch_set_v1(keys, where, info([])) == [False, False]
        s.start()
        wait_for(lambda: store.batch_set_v1(keys, where, info([])) == [True, True])
        assert store.batch_exists(keys, info([])) == 2
    finally:
        store.close()
        s.stop()
        s.cleanup()


def test_bad_host_indices_are_a_failed_call_not_an_exception(sidecar: Sidecar) -> None:
    pool = host_pool(page_size=4)
    store = backend(pool, sidecar.endpoint)
    keys, where = page_keys(31, 2, 4), pool.alloc(8)
    try:
        assert store.batch_set_v1(keys, where[1:], info([])) == [False, False]  # 7 indices
        assert store.batch_set_v1(keys, where + 1, info([])) == [False, False]  # mid-page
        assert store.batch_exists(keys, info([])) == 0
    finally:
        store.close()


def _mxfp8_pool() -> type:
    """SGLang's MXFP8 host pool (its constructor needs CUDA: the test makes
    one bare): an MHATokenToKVPoolHost whose pages' scales lie outside
    kv_buffer."""
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

    return MHATokenToKVPoolMXFP8Host


@pytest.mark.parametrize(
    ("pool", "said"),
    [
        (lambda: host_pool("mla"), "is_mla_model"),
        (lambda: object(), "MHATokenToKVPoolHost"),
        (lambda: object.__new__(_mxfp8_pool()), "not MHATokenToKVPoolMXFP8Host"),
    ],
    ids=["mla-pool-for-an-mha-config", "not-a-host-pool", "mxfp8-scales-outside-kv-buffer"],
)
def test_a_pool_it_cannot_serve_fails_the_attach(pool: object, said: str) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    store = StorageBackendFactory.create_backend(
        "dynamic", storage_config("ipc:///nonexistent.sock"), None
    )
    with pytest.raises(ValueError, match=said):
        store.register_mem_pool_host(pool())  # type: ignore[operator]
    store.close()
