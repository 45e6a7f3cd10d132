"""The connector's tensor-parallel worker logic without vLLM (CI): two
`WorkerSide`s as TP ranks 0 and 1 of one engine (in one process here; the
vLLM-driven test runs them as processes), each with its own KV, on a real
sidecar. The leader's plans reach the follower through `RankRelay`; each
rank's blocks load back byte for byte into that rank."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
from sidecar_proc import DEADLINE, Sidecar, stats_of
from vllm_helpers import (
    BLOCK,
    GEOMETRY,
    StepOutput,
    Tables,
    blocks_of,
    kv_caches,
    matched_eventually,
    prompt,
    request,
    settings,
)

from engine_shim.channel import SidecarError
from engine_shim.kvconnector.metadata import ConnectorMeta, LoadSpec
from engine_shim.kvconnector.parallel import Parallel
from engine_shim.kvconnector.relay import RankRelay
from engine_shim.kvconnector.scheduler import SchedulerSide
from engine_shim.kvconnector.worker import WorkerSide


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="4MiB").start()
    yield s
    s.cleanup()


def all_finished(workers: list[WorkerSide], want: tuple[set[str], set[str]]) -> None:
    """Every rank reports `want` (its transfers run on its thread)."""
    for worker in workers:
        got: tuple[set[str], set[str]] = (set(), set())
        deadline = time.monotonic() + DEADLINE
        while got != want:
            sending, recving = worker.finished()
            got = (got[0] | sending, got[1] | recving)
            assert time.monotonic() < deadline, (got, want)
            time.sleep(0.002)


@pytest.mark.parametrize("load_async", [True, False])
def test_two_ranks_save_and_load_their_own_shards(sidecar, load_async):
    s = settings(sidecar.endpoint, load_async=load_async)
    kvs = [kv_caches(seed=10), kv_caches(seed=11)]  # each rank's heads differ
    workers = [WorkerSide(s, GEOMETRY, Parallel(rank, 2)) for rank in range(2)]
    tables = Tables()
    sched = SchedulerSide(
        s, GEOMETRY, use_block_hashes=False, block_table=tables, parallel=Parallel(0, 2)
    )
    try:
        for worker, kv in zip(workers, kvs, strict=True):
            worker.register(kv)
        tokens = prompt(3 * BLOCK + 1, start=5)
        req = request("a", tokens)
        tables["a"] = [0, 1, 2, 3]
        sched.after_alloc(req, [0, 1, 2, 3], 0)
        meta = sched.build_meta(StepOutput({"a": len(tokens)}))
        for worker in reversed(workers):  # the follower first: it waits for the leader
            worker.start_loads(meta)
            worker.run_saves(meta)
        req.num_computed_tokens = len(tokens)
        assert sched.finished(req) is True
        meta = sched.build_meta(StepOutput())
        for worker in workers:
            worker.run_saves(meta)
        all_finished(workers, ({"a"}, set()))
        assert stats_of(sidecar)["transfers"]["saved_blocks"] == 3

        other = request("b", tokens)
        matched_eventually(sched, other, (3 * BLOCK, load_async))
        tables["b"] = [9, 10, 11, 12]
        sched.after_alloc(other, [9, 10, 11, 12], 3 * BLOCK)
        meta = sched.build_meta(StepOutput())
        for worker in workers:
            if load_async:
                worker.start_loads(meta)
        if not load_async:  # a synchronous load blocks until its plan: run the ranks at once
            threads = [threading.Thread(target=w.start_loads, args=(meta,)) for w in workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(DEADLINE)
            for worker in workers:
                worker.run_saves(meta)
        else:
            all_finished(workers, (set(), {"b"}))
        for worker, kv in zip(workers, kvs, strict=True):
            assert worker.load_errors() == set()
            for got, want in zip(blocks_of(kv, [9, 10, 11]), blocks_of(kv, [0, 1, 2]), strict=True):
                assert np.array_equal(got, want)
    finally:
        sched.close()
        for worker in workers:
            worker.close()


def save_through(sched: SchedulerSide, workers: list[WorkerSide], tables: Tables, tokens):
    """Request "a" computes `tokens` in one step on every rank and finishes."""
    req = request("a", tokens)
    tables["a"] = list(range(len(tokens) // BLOCK + 1))
    sched.after_alloc(req, tables["a"], 0)
    meta = sched.build_meta(StepOutput({"a": len(tokens)}))
    for worker in workers:
        worker.run_saves(meta)
    req.num_computed_tokens = len(tokens)
    assert sched.finished(req) is True
    meta = sched.build_meta(StepOutput())
    for worker in workers:
        worker.run_saves(meta)
    all_finished(workers, ({"a"}, set()))


def test_a_follower_without_its_leader_recomputes_and_cancels_the_late_plan(sidecar):
    """The follower gives up on its leader's plan (RELAY_WAIT timeouts) and
    reports the load for recompute; the plan that comes later is cancelled,
    not run, so the sidecar unlocks its blocks."""
    s = settings(sidecar.endpoint, timeout=0.2)
    leader, follower = (WorkerSide(s, GEOMETRY, Parallel(rank, 2)) for rank in range(2))
    tables = Tables()
    sched = SchedulerSide(
        s, GEOMETRY, use_block_hashes=False, block_table=tables, parallel=Parallel(0, 2)
    )
    try:
        leader.register(kv_caches(seed=12))
        follower_kv = kv_caches(seed=13)
        follower.register(follower_kv)
        untouched = blocks_of(follower_kv, [8, 9])
        tokens = prompt(2 * BLOCK + 1, start=70)
        save_through(sched, [leader, follower], tables, tokens)
        keys = sched.request_keys(request("b", tokens), 2)
        late = ConnectorMeta(step=100, loads=(LoadSpec("b", keys, np.array([8, 9]), 0),))
        follower.start_loads(late)  # the leader is not there yet
        all_finished([follower], (set(), {"b"}))
        assert follower.load_errors() == {8, 9}
        leader.start_loads(late)  # now it plans and copies, and relays the plan
        all_finished([leader], (set(), {"b"}))
        with pytest.raises(SidecarError, match=r"(?i)busy|in use"):
            sched._client.delete(tokens[: 2 * BLOCK])  # the plan still locks the blocks

        on_time = ConnectorMeta(step=101, loads=(LoadSpec("c", keys, np.array([12, 13]), 0),))
        leader.start_loads(on_time)
        follower.start_loads(on_time)  # takes its plan, cancels the late one first
        all_finished([leader, follower], (set(), {"c"}))
        assert follower.load_errors() == set() and leader.load_errors() == set()
        deadline = time.monotonic() + DEADLINE
        while True:  # the late plan is rolled back: nothing locks the blocks
            try:
                assert sched._client.delete(tokens[: 2 * BLOCK]) == 1  # the 2nd block
                break
            except SidecarError:
                assert time.monotonic() < deadline, "the late plan still holds the blocks"
                time.sleep(0.01)
        for got, want in zip(blocks_of(follower_kv, [8, 9]), untouched, strict=True):
            assert np.array_equal(got, want), "the late plan was run, not cancelled"
    finally:
        sched.close()
        leader.close()
        follower.close()


def test_the_relay_keeps_messages_until_asked_and_cleans_up():
    engine_id = f"relay-{uuid.uuid4().hex[:8]}"
    leader, follower = RankRelay(engine_id, 0, 2), RankRelay(engine_id, 1, 2)
    try:
        leader.send((1, "save", "a"), "first")
        leader.send((1, "load", "b"), {"plan": [1, 2]})
        assert follower.take((1, "load", "b"), DEADLINE) == {"plan": [1, 2]}
        assert follower.take((1, "save", "a"), DEADLINE) == "first"
        with pytest.raises(TimeoutError, match="no plan from the leader"):
            follower.take((2, "save", "a"), 0.05)
        path = follower._path
        assert path is not None and path.exists()
    finally:
        leader.close()
        follower.close()
    assert not path.exists()


def test_bad_parallel_settings_are_refused():
    for bad, match in (
        ({"tp_rank": 2, "tp_size": 2}, "out of range"),
        ({"tp_rank": -1, "tp_size": 2}, "out of range"),
        ({"tp_rank": True, "tp_size": 2}, "must be an int"),
    ):
        with pytest.raises(ValueError, match=match):
            Parallel(**bad)
    mla = Parallel(1, 4, one_copy=True)
    assert (mla.shards, mla.relayed, mla.saves) == (1, False, False)
    assert mla.engine_id("e") == "e-worker-mla1"
    assert mla.register_args() == {"tp_rank": 0, "tp_size": 1}
    assert Parallel(3, 4).register_args() == {"tp_rank": 3, "tp_size": 4}
