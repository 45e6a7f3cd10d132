"""The vLLM connector's two halves against a real sidecar process, without
vLLM: small CPU KV tensors in vLLM's FlashAttention layout and plain
request objects with the attributes the connector reads (tests/vllm_helpers)."""

from __future__ import annotations

import dataclasses
import signal
import time

import numpy as np
import pytest
import torch
from sidecar_proc import DEADLINE, Sidecar
from vllm_helpers import (
    BLOCK,
    GEOMETRY,
    StepOutput,
    blocks_of,
    halves,
    kv_caches,
    prompt,
    request,
    scheduler_side,
    settings,
    tables_of,
)

import engine_shim.vllm_connector as glue
from engine_shim.client import KVClient, SidecarUnavailable
from engine_shim.kvconnector.lookups import Lookups
from engine_shim.kvconnector.metadata import ConnectorMeta, LoadSpec
from engine_shim.kvconnector.scheduler import SchedulerSide
from engine_shim.kvconnector.settings import ConnectorSettings
from engine_shim.kvconnector.worker import WorkerSide


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="4MiB").start()
    yield s
    try:
        if s.proc is not None and s.proc.poll() is None:  # not killed by the test
            assert s.stop() == 0
            assert s.shm_segments() == [], "shm segments outlived the sidecar"
    finally:
        s.cleanup()


@pytest.fixture
def make_pair(sidecar):
    """Builds (scheduler side, worker side, KV) with settings overrides; closes them."""
    made = []

    def make(seed: int = 1, **overrides):
        kv = kv_caches(seed=seed)
        sched, worker = halves(sidecar.endpoint, kv, **overrides)
        made.extend((sched, worker))
        return sched, worker, kv

    yield make
    for side in made:
        side.close()


@pytest.fixture
def pair(make_pair):
    return make_pair()


def finished_eventually(worker: WorkerSide) -> tuple[set[str], set[str]]:
    """worker.finished() once it reports something (the transfers run on a thread)."""
    deadline = time.monotonic() + DEADLINE
    while not any(got := worker.finished()):
        assert time.monotonic() < deadline, "nothing finished"
        time.sleep(0.002)
    return got


def step(sched: SchedulerSide, worker: WorkerSide, scheduled: dict[str, int]) -> ConnectorMeta:
    """One vLLM step computing `scheduled` tokens per request: the worker
    runs its loads and queues its saves."""
    meta = sched.build_meta(StepOutput(scheduled))
    worker.start_loads(meta)
    worker.run_saves(meta)
    return meta


def save(sched: SchedulerSide, worker: WorkerSide, req, block_ids: list[int]) -> None:
    """vLLM prefilling `req` in one step, then finishing it: its full blocks
    are offered in the step, vLLM keeps them until the save is reported."""
    tables_of(sched)[req.request_id] = block_ids
    sched.after_alloc(req, block_ids, 0)
    n = len(req.all_token_ids)
    meta = step(sched, worker, {req.request_id: n})
    assert [s.req_id for s in meta.saves] == ([req.request_id] if n >= BLOCK else [])
    req.num_computed_tokens = n
    assert sched.finished(req) is (n >= BLOCK)  # keep the blocks: a save is pending
    if n >= BLOCK:
        step(sched, worker, {})
        assert finished_eventually(worker) == ({req.request_id}, set())


def cached(sched: SchedulerSide, worker: WorkerSide, tokens: list[int], block_ids: list[int]):
    """`tokens` saved by a finished request "a"; a new request "b" for them."""
    save(sched, worker, request("a", tokens), block_ids)
    return request("b", tokens)


def test_lookup_then_load_is_byte_exact(pair):
    sched, worker, kv = pair
    tokens = prompt(3 * BLOCK + 5)
    save(sched, worker, request("a", tokens), [0, 1, 2, 3])
    want = blocks_of(kv, [0, 1, 2])

    req = request("b", tokens)
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    sched.after_alloc(req, [10, 11, 12, 13], 3 * BLOCK)
    meta = sched.build_meta(StepOutput())
    assert [(s.req_id, s.block_ids.tolist(), s.skip_blocks) for s in meta.loads] == [
        ("b", [10, 11, 12], 0)
    ]
    assert sched.build_meta(StepOutput()).loads == ()  # handed out once
    worker.start_loads(meta)
    assert finished_eventually(worker) == (set(), {"b"})
    assert worker.load_errors() == set()
    for got, expected in zip(blocks_of(kv, [10, 11, 12]), want, strict=True):
        assert np.array_equal(got, expected)


def test_a_local_hit_is_skipped_and_the_last_token_never_claimed(pair):
    sched, worker, kv = pair
    tokens = prompt(3 * BLOCK)  # exactly 3 blocks: only 2 may be loaded
    save(sched, worker, request("a", tokens), [0, 1, 2])
    for t in kv.values():
        t[20:23] = 0
    req = request("b", tokens)
    assert sched.num_new_matched_tokens(req, 2 * BLOCK) == (0, False)
    assert sched.num_new_matched_tokens(req, BLOCK) == (BLOCK, True)
    sched.after_alloc(req, [20, 21, 22], BLOCK)
    worker.start_loads(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == (set(), {"b"})
    assert not blocks_of(kv, [20])[0].any(), "the local hit was overwritten"
    assert np.array_equal(blocks_of(kv, [21])[0], blocks_of(kv, [1])[0])


def test_ask_again_while_the_lookup_is_in_flight(sidecar, make_pair):
    sched, worker, _ = make_pair(seed=2, lookup_async=True, timeout=10.0)
    tokens = prompt(2 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1])
    # A stopped sidecar keeps the lookup in flight for sure (a running one
    # may answer before the first poll returns), if it is asked: its hot
    # index would answer in the scheduler's process at once.
    sched._client.hot_path = False
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        assert sched.num_new_matched_tokens(req, 0) == (None, False)
        time.sleep(0.05)
        assert sched.num_new_matched_tokens(req, 0) == (None, False)
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + DEADLINE
    while (answer := sched.num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert answer == (2 * BLOCK, True)
    # The answer stands until allocation: asking again does not look up again.
    assert sched.num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
    sched.after_alloc(req, [5, 6, 7], 2 * BLOCK)
    worker.start_loads(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == (set(), {"b"})


def test_a_request_offers_only_what_it_did_not_load(pair):
    sched, worker, _ = pair
    tokens = prompt(2 * BLOCK + 3)
    req = cached(sched, worker, tokens, [0, 1, 2])
    assert sched.num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
    tables_of(sched)["b"] = [4, 5, 6]
    sched.after_alloc(req, [4, 5, 6], 2 * BLOCK)
    worker.start_loads(sched.build_meta(StepOutput()))
    finished_eventually(worker)
    req.num_computed_tokens = 2 * BLOCK
    assert step(sched, worker, {"b": 3}).saves == ()  # no block completed past the load
    req.num_computed_tokens = len(tokens)
    assert sched.finished(req) is False  # nothing offered: free at once
    short = request("c", prompt(BLOCK - 1))
    tables_of(sched)["c"] = [7]
    sched.after_alloc(short, [7], 0)
    assert step(sched, worker, {"c": BLOCK - 1}).saves == ()
    assert sched.finished(short) is False
    assert sched.build_meta(StepOutput()) == ConnectorMeta(step=sched._step)


def test_each_block_is_offered_in_the_step_that_completes_it(pair):
    """Chunked prefill then decode: every full block is offered once, in its
    step; a second request hits the prefix while the first still runs."""
    sched, worker, kv = pair
    tokens = prompt(3 * BLOCK + 2, start=40)
    req = request("a", tokens)
    tables_of(sched)["a"] = [5, 6, 7, 8]
    sched.after_alloc(req, [5, 6, 7, 8], 0)
    offered = []
    for n in (BLOCK + 3, BLOCK, BLOCK - 3 + 2):  # three chunks of the prompt
        meta = step(sched, worker, {"a": n})
        offered.append([(s.block_ids.tolist(), s.new_blocks) for s in meta.saves])
        req.num_computed_tokens += n
    assert offered == [[([5], 1)], [([5, 6], 1)], [([5, 6, 7], 1)]]
    other = request("b", tokens)
    deadline = time.monotonic() + DEADLINE
    while sched.num_new_matched_tokens(other, 0) != (3 * BLOCK, True):  # saves land
        sched._forget("b")
        assert time.monotonic() < deadline
        time.sleep(0.005)
    req.all_token_ids += list(range(BLOCK - 2))  # decode up to the end of block 3
    for _ in range(BLOCK - 2):
        meta = step(sched, worker, {"a": 1})
        req.num_computed_tokens += 1
    assert [(s.block_ids.tolist(), s.new_blocks) for s in meta.saves] == [([5, 6, 7, 8], 1)]
    assert sched.finished(req) is True
    step(sched, worker, {})
    assert finished_eventually(worker) == ({"a"}, set())
    tables_of(sched)["b"] = [20, 21, 22]
    sched.after_alloc(other, [20, 21, 22], 3 * BLOCK)
    worker.start_loads(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == (set(), {"b"})
    for got, want in zip(blocks_of(kv, [20, 21, 22]), blocks_of(kv, [5, 6, 7]), strict=True):
        assert np.array_equal(got, want)


def test_vllm_block_hashes_key_the_blocks(make_pair):
    sched, worker, _ = make_pair(seed=3, use_block_hashes=True)
    tokens = prompt(2 * BLOCK + 1)
    save(sched, worker, request("a", tokens), [0, 1])
    assert sched.num_new_matched_tokens(request("b", tokens), 0) == (2 * BLOCK, True)
    # Other hashes of the same tokens (another cache salt, an image): a miss.
    assert sched.num_new_matched_tokens(request("c", tokens, salt=b"x"), 0) == (0, False)
    by_tokens = scheduler_side(sched.settings, use_block_hashes=False)
    try:  # the two key sources never meet
        assert by_tokens.num_new_matched_tokens(request("d", tokens), 0) == (0, False)
    finally:
        by_tokens.close()


def test_token_keys_skip_requests_their_tokens_do_not_describe(pair):
    sched, worker, _ = pair
    tokens = prompt(2 * BLOCK + 1)
    save(sched, worker, request("a", tokens), [0, 1])
    embeds = torch.zeros(len(tokens), 8)  # vLLM then holds 0 for every token id
    for extra in (
        {"mm_features": ["image"]},
        {"lora_request": "adapter"},
        {"cache_salt": "s"},
        {"prompt_embeds": embeds},
    ):
        req = request("b", tokens)
        for name, value in extra.items():
            setattr(req, name, value)
        assert sched.num_new_matched_tokens(req, 0) == (0, False)
        sched.after_alloc(req, [3, 4], 0)
        assert sched.build_meta(StepOutput({"b": len(tokens)})).saves == ()
        assert sched.finished(req) is False


def test_a_load_from_a_killed_sidecar_is_reported_for_recompute(sidecar, pair):
    sched, worker, _ = pair
    tokens = prompt(3 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1, 2])
    assert sched.num_new_matched_tokens(req, BLOCK) == (2 * BLOCK, True)
    sched.after_alloc(req, [8, 9, 10, 11], 2 * BLOCK)
    # Asked of the sidecar (its hot index would still serve the intact CPU
    # hits until its stamp is older than the timeout: test_hotpath.py).
    worker._client.hot_path = sched._client.hot_path = False
    sidecar.kill()
    started = time.monotonic()
    worker.start_loads(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == (set(), {"b"})  # finished receiving, with errors
    assert worker.load_errors() == {9, 10}
    assert worker.load_errors() == set()
    # Later lookups miss fast; a save is dropped but still frees the blocks.
    assert sched.num_new_matched_tokens(request("c", tokens), 0) == (0, False)
    save(sched, worker, request("d", prompt(BLOCK + 1, start=7)), [12, 13])
    assert time.monotonic() - started < 10


def test_a_block_evicted_after_the_lookup_is_reported(pair):
    sched, worker, kv = pair
    tokens = prompt(3 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1, 2])
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    sched.after_alloc(req, [8, 9, 10, 11], 3 * BLOCK)
    assert sched._client.delete(tokens[: 2 * BLOCK]) == 2  # blocks 1 and 2 go
    worker.start_loads(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == (set(), {"b"})
    assert worker.load_errors() == {9, 10}
    assert np.array_equal(blocks_of(kv, [8])[0], blocks_of(kv, [0])[0])


def test_synchronous_loads_wait_per_layer(make_pair):
    sched, worker, kv = make_pair(seed=4, load_async=False)
    tokens = prompt(2 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1])
    assert sched.num_new_matched_tokens(req, 0) == (2 * BLOCK, False)
    sched.after_alloc(req, [3, 4, 5], 2 * BLOCK)
    meta = sched.build_meta(StepOutput())
    worker.start_loads(meta)
    for name in kv:
        worker.wait_for_layer(name)
    with pytest.raises(ValueError, match="unknown KV layer"):
        worker.wait_for_layer("model.layers.9.self_attn.attn")
    worker.run_saves(meta)
    assert worker.finished() == (set(), set())  # synchronous: not reported
    assert worker.load_errors() == set()
    assert np.array_equal(blocks_of(kv, [3, 4])[1], blocks_of(kv, [0, 1])[1])


# ---- bad input: a clear error, no state change ----------------------------------------


def test_bad_settings_are_refused():
    base = {"model_name": "m", "model_revision": "r", "engine_id": "e"}
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['endpiont'\]"):
        ConnectorSettings.from_extra_config({"endpiont": "ipc://x"}, **base)
    for bad in (
        {"block_keys": "hashes"},
        {"load_async": "yes"},
        {"timeout": 0},
        {"timeout": float("nan")},
        {"timeout": float("inf")},
        {"model_revision": ""},
        {"endpoint": 5},
        {"endpoint": ""},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ConnectorSettings.from_extra_config(bad, **base)
    s = ConnectorSettings.from_extra_config({"tenant": "t"}, **base)
    assert (s.tenant, s.load_async, s.block_keys) == ("t", True, "auto")


def test_kv_caches_of_another_geometry_are_refused(sidecar):
    worker = WorkerSide(settings(sidecar.endpoint), GEOMETRY)
    kv = kv_caches(seed=None)
    first = next(iter(kv.values()))
    for caches, match in (
        ({n: t.contiguous() for n, t in kv.items()}, "not a LBNHC view.*memory order"),  # LBHNC
        ({n: t[:, :, :, :8] for n, t in kv.items()}, "not a LBNHC view.*runs of"),
        ({"only": first}, "1 KV tensors for 2 layers"),
        ({}, "non-empty"),
        ({n: t.half() for n, t in kv.items()}, "torch.float16"),
        ({n: t[0] for n, t in kv.items()}, r"4D \[B, H, N, C\]"),
    ):
        with pytest.raises(ValueError, match=match):
            worker.register(caches)
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.start_loads(ConnectorMeta(loads=(LoadSpec("x", _keys(1), np.zeros(1), 0),)))
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT"):
        dataclasses.replace(GEOMETRY, layout="NHD")


def test_bad_scheduler_calls_change_nothing(pair):
    sched, worker, _ = pair
    tokens = prompt(2 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1])
    with pytest.raises(ValueError, match="num_computed_tokens"):
        sched.num_new_matched_tokens(req, -1)
    assert sched.num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
    with pytest.raises(ValueError, match="not the 2-block hit"):
        sched.after_alloc(req, [1, 2, 3, 4], 3 * BLOCK)
    with pytest.raises(ValueError, match="1 blocks for a 2-block load"):
        sched.after_alloc(req, [1], 2 * BLOCK)
    assert sched.build_meta(StepOutput()).loads == ()
    sched.after_alloc(req, [1, 2, 3], 2 * BLOCK)  # the hit still stands
    assert [s.block_ids.tolist() for s in sched.build_meta(StepOutput()).loads] == [[1, 2]]


def test_kvclient_key_methods_validate(pair):
    sched, _, _ = pair
    client = sched._client
    keys = client.block_keys(prompt(2 * BLOCK))
    assert client.lookup_keys(keys) == 0
    for bad in (b"\x00" * 32, np.zeros(2, np.uint8), keys.reshape(1, 2), list(keys)):
        with pytest.raises(TypeError, match="block keys"):
            client.lookup_keys(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="block keys"):
            client.save_keys(bad, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 full blocks of tokens but 1 block ids"):
        client.load_keys(keys, [0])
    with pytest.raises(ValueError, match="one length"):
        client.digest_keys([b"a" * 32, b"b" * 16])
    with pytest.raises(ValueError, match="one length"):
        client.digest_keys([b"short"])
    with pytest.raises(ValueError, match="must be bytes"):
        client.digest_keys(["text" * 8])  # type: ignore[list-item]


def test_the_glue_imports_without_vllm_and_reads_vllm_config(monkeypatch):
    from types import SimpleNamespace as NS

    config = NS(
        parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
        kv_transfer_config=NS(kv_connector_extra_config={"tenant": "t"}, engine_id="e1"),
        model_config=NS(model="org/model", revision=None),
        cache_config=NS(prefix_caching_hash_algo="sha256", hash_block_size=None),
    )
    s = glue.settings_of(config)
    assert (s.model_name, s.model_revision, s.engine_id, s.tenant) == (
        "org/model",
        "unpinned",
        "vllm-e1-dp0",
        "t",
    )
    # "auto": vLLM's hashes only when the same in every process and collision-resistant
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert not glue.uses_block_hashes(s, config, 16)  # a random chain root per process
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert glue.uses_block_hashes(s, config, 16)
    config.cache_config.prefix_caching_hash_algo = "xxhash"
    assert not glue.uses_block_hashes(s, config, 16)
    config.parallel_config.tensor_parallel_size = 2
    assert glue.settings_of(config).engine_id == "vllm-e1-dp0"  # any TP size
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline parallelism"):
        glue.settings_of(config)


def _keys(n: int):
    from contract.ids import keys_from_ints

    return keys_from_ints(list(range(n)))


def test_halves_made_before_the_sidecar_starts_work_once_it_is_up():
    late = Sidecar(capacity="4MiB")
    try:
        kv = kv_caches(seed=5)
        sched, worker = halves(late.endpoint, kv, timeout=0.3)  # both registrations fail
        tokens = prompt(2 * BLOCK + 1)
        assert sched.num_new_matched_tokens(request("x", tokens), 0) == (0, False)
        late.start()
        deadline = time.monotonic() + DEADLINE  # until the sockets reconnect (<= 1 s apart)
        while sched.num_new_matched_tokens(cached(sched, worker, tokens, [0, 1]), 0)[0] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # Registered late, the leases are renewed all the same (not only by traffic).
        assert sched._client._link.heartbeat is not None
        assert worker._client is not None and worker._client._link.heartbeat is not None
        sched.close()
        worker.close()
        assert late.stop() == 0
    finally:
        late.cleanup()


def test_a_stalled_sidecar_delays_each_request_at_most_one_timeout(sidecar, make_pair):
    """Lookups queued behind one that hangs on a stopped sidecar must not wait
    in turn: each request is answered as a miss within about `timeout`."""
    timeout = 0.4
    sched, _, _ = make_pair(seed=6, lookup_async=True, timeout=timeout)
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        reqs = [request(f"r{i}", prompt(2 * BLOCK + 1, start=100 * i)) for i in range(6)]
        started = time.monotonic()
        waited: dict[str, float] = {}
        while len(waited) < len(reqs):
            for req in reqs:
                if req.request_id not in waited:
                    answer = sched.num_new_matched_tokens(req, 0)
                    if answer[0] is not None:
                        assert answer == (0, False)
                        waited[req.request_id] = time.monotonic() - started
            assert time.monotonic() - started < 30
            time.sleep(0.01)
        assert max(waited.values()) < 2 * timeout, waited
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)


def test_a_registration_whose_reply_came_late_is_completed_before_a_load(sidecar, pair):
    """The sidecar registered the session but its reply missed the timeout:
    the client never mapped the pool. A later load must not trip on that."""
    sched, worker, kv = pair
    tokens = prompt(2 * BLOCK + 1)
    save(sched, worker, request("a", tokens), [0, 1])
    late_kv = kv_caches(seed=None)
    client = KVClient.connect(sidecar.endpoint, timeout=0.3)
    try:
        client.stats()  # connected: the Register below is sent, only its reply is late
        sidecar.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(SidecarUnavailable):
                client.register(
                    GEOMETRY.planes(late_kv),
                    engine_id=f"{sched.settings.engine_id}-late",
                    **GEOMETRY.register_args(sched.settings),
                )
        finally:
            sidecar.proc.send_signal(signal.SIGCONT)
        keys = client.block_keys(tokens)
        assert client.load_keys(keys, [20, 21]).wait() == 2 * BLOCK
        for got, want in zip(blocks_of(late_kv, [20, 21]), blocks_of(kv, [0, 1]), strict=True):
            assert np.array_equal(got, want)
    finally:
        client.close()


def test_a_short_synchronous_load_is_reported_before_wait_for_save(make_pair):
    """With speculative decoding vLLM reads the load errors before it calls
    wait_for_save (defer_finalize): a short synchronous load must be reported
    in that step's pass, once."""
    sched, worker, kv = make_pair(seed=7, load_async=False)
    tokens = prompt(3 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1, 2])
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    sched.after_alloc(req, [8, 9, 10, 11], 3 * BLOCK)
    assert sched._client.delete(tokens[: 2 * BLOCK]) == 2  # blocks 1 and 2 go
    meta = sched.build_meta(StepOutput())
    worker.start_loads(meta)
    assert worker.finished() == (set(), set())
    assert worker.load_errors() == {9, 10}  # the step's pass, before its wait_for_save
    worker.run_saves(meta)
    assert worker.finished() == (set(), set())
    assert worker.load_errors() == set()  # not reported again next step
    assert np.array_equal(blocks_of(kv, [8])[0], blocks_of(kv, [0])[0])


def test_a_short_synchronous_load_offers_nothing_of_its_step_and_what_failed_again(make_pair):
    """The load's step computes past blocks that may not have loaded: none
    of it is offered then (the sidecar would store what the engine held
    there). Once vLLM reports the blocks that failed, the request offers
    again from the first, as it recomputes them."""
    sched, worker, _ = make_pair(seed=8, load_async=False)
    tokens = prompt(3 * BLOCK + 1)
    cached(sched, worker, tokens, [0, 1, 2])
    longer = [*tokens[: 3 * BLOCK], *prompt(2 * BLOCK + 1, start=9000)]
    req = request("b", longer)
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    table = [8, 9, 10, 11, 12, 13]
    tables_of(sched)["b"] = table
    sched.after_alloc(req, table, 3 * BLOCK)
    assert sched._client.delete(tokens[: 2 * BLOCK]) == 2  # blocks 1 and 2 go
    meta = step(sched, worker, {"b": len(longer) - 3 * BLOCK})  # the rest of the prompt
    assert meta.loads and not meta.saves
    assert worker.load_errors() == {9, 10}
    sched.load_failed({9, 10})  # vLLM: b computes again from its block 1
    req.num_computed_tokens = BLOCK
    meta = step(sched, worker, {"b": len(longer) - BLOCK})
    (spec,) = meta.saves
    assert len(spec.keys) == 5 and spec.new_blocks == 4  # blocks 1-4, recomputed now
    assert spec.block_ids.tolist() == table[:5]


@pytest.mark.parametrize("background", [False, True])
def test_a_lookup_that_raises_is_a_logged_miss(pair, monkeypatch, caplog, background):
    """Not an exception in vLLM's scheduler (which would stop the engine)."""
    sched, _, _ = pair
    client = sched._client

    def broken(keys):
        raise RuntimeError("the restarted sidecar's shm could not be mapped")

    monkeypatch.setattr(client, "lookup_keys", broken)
    lookups = Lookups(client, background=background)
    try:
        keys = client.block_keys(np.asarray(prompt(BLOCK), dtype=np.int64))
        deadline = time.monotonic() + DEADLINE
        while (hit := lookups.poll("r", keys)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert hit == 0 and "a lookup failed" in caplog.text
    finally:
        lookups.close()


def test_a_preempted_request_needs_no_delayed_free_for_its_earlier_saves(pair):
    """Its saves land before its blocks are used again (handle_preemptions):
    aborted later (say while it loads, resumed), vLLM must not be told to
    keep its blocks for them, or it frees the request twice."""
    sched, worker, _ = pair
    req = request("a", prompt(2 * BLOCK + 1))
    tables_of(sched)["a"] = [0, 1, 2]
    sched.after_alloc(req, [0, 1, 2], 0)
    assert step(sched, worker, {"a": len(req.all_token_ids)}).saves
    req.num_computed_tokens = len(req.all_token_ids)
    meta = sched.build_meta(StepOutput({}, {"a"}))  # preempted
    worker.handle_preemptions(meta)
    assert sched.finished(req) is False


@pytest.mark.parametrize("use_block_hashes", [False, True])
def test_keys_extended_block_by_block_equal_keys_hashed_at_once(make_pair, use_block_hashes):
    """The scheduler side hashes only the blocks a step completes, from the
    keys it has: the same keys as hashing the whole prefix again."""
    sched, _, _ = make_pair(seed=8, use_block_hashes=use_block_hashes)
    req = request("k", prompt(6 * BLOCK + 3, start=9))
    whole = sched.request_keys(req, 6)
    known = sched.request_keys(req, 2)
    for n in (2, 3, 6):
        known = sched.request_keys(req, n, known)
        assert np.array_equal(known, whole[:n])
    assert np.array_equal(sched.request_keys(req, 4, whole), whole[:4])
