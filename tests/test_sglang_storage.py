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

from collections.abc import Iterator

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
from sidecar_proc import SPAWN, Sidecar

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
