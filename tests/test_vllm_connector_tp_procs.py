"""TP=2 as two processes, without vLLM: each rank a spawned process with its
own `WorkerSide` and KV (CPU tensors; CUDA tensors, fp32 and bf16, where a
GPU is), the scheduler side in this process, one real sidecar. The leader
relays its plans to the follower across the processes. A request's blocks
are saved from both ranks, then a second request sharing the prefix loads
them into other blocks of each rank, byte for byte what that rank saved;
per step and layer-wise. (tests/test_vllm_connector_tp.py runs the same
through vLLM's own classes where vLLM is installed.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_helpers import why_no_gpu
from sidecar_proc import Sidecar, stats_of
from vllm_helpers import (
    BLOCK,
    GEOMETRY,
    StepOutput,
    Tables,
    matched_eventually,
    prompt,
    request,
    settings,
)
from worker_ranks import Rank

from engine_shim.kvconnector.parallel import Parallel
from engine_shim.kvconnector.scheduler import SchedulerSide

NO_GPU = why_no_gpu()
ON_GPU = pytest.mark.skipif(NO_GPU is not None, reason=str(NO_GPU))
DEVICES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=ON_GPU),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=ON_GPU),
]


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="4MiB").start()
    yield s
    s.cleanup()


def step_all(ranks: list[Rank], meta) -> None:
    """Both ranks run the step at once (a synchronous load's follower waits
    for the leader's relayed plan)."""
    for rank in ranks:
        rank.send("step", meta)
    assert [rank.answer() for rank in ranks] == ["stepped"] * len(ranks)


def all_finished(ranks: list[Rank], want: tuple[set[str], set[str]]) -> None:
    for rank in ranks:
        rank.send("finished", want)
    assert [rank.answer() for rank in ranks] == [want] * len(ranks)


def copied(ranks: list[Rank], source: list[int], target: list[int]) -> list[tuple[bool, set[str]]]:
    for rank in ranks:
        rank.send("copied", (source, target))
    return [rank.answer() for rank in ranks]


@pytest.mark.parametrize("layer_wise", [False, True], ids=["per-step", "layer-wise"])
@pytest.mark.parametrize("device, dtype", DEVICES)
def test_two_rank_processes_save_and_load_their_own_shards(sidecar, device, dtype, layer_wise):
    """Per step: the load is asynchronous. Layer-wise: each layer's save
    starts in its hook, and the load is synchronous, waited for per layer."""
    load_async = not layer_wise
    geometry = dataclasses.replace(GEOMETRY, dtype=dtype)
    s = settings(sidecar.endpoint, load_async=load_async, layer_wise=layer_wise)
    tables = Tables()
    sched = SchedulerSide(
        s, geometry, use_block_hashes=False, block_table=tables, parallel=Parallel(0, 2)
    )
    ranks: list[Rank] = []
    try:
        ranks.extend(Rank(s, geometry, rank, 2, device) for rank in range(2))
        # vLLM steps only once every worker has registered its KV.
        assert [rank.answer() for rank in ranks] == ["registered"] * 2
        tokens = prompt(3 * BLOCK + 1, start=7)
        req = request("a", tokens)
        tables["a"] = [0, 1, 2, 3]
        sched.after_alloc(req, [0, 1, 2, 3], 0)
        step_all(ranks, sched.build_meta(StepOutput({"a": len(tokens)})))
        req.num_computed_tokens = len(tokens)
        assert sched.finished(req) is True
        step_all(ranks, sched.build_meta(StepOutput()))
        all_finished(ranks, ({"a"}, set()))
        assert stats_of(sidecar)["transfers"]["saved_blocks"] == 3

        source, target = [0, 1, 2], [9, 10, 11]
        assert [same for same, _ in copied(ranks, source, target)] == [False, False]
        other = request("b", tokens)
        matched_eventually(sched, other, (3 * BLOCK, load_async))
        tables["b"] = [*target, 12]
        sched.after_alloc(other, [*target, 12], 3 * BLOCK)
        step_all(ranks, sched.build_meta(StepOutput({"b": 1})))
        if load_async:
            all_finished(ranks, (set(), {"b"}))
        assert copied(ranks, source, target) == [(True, set()), (True, set())]
    finally:
        sched.close()
        for rank in ranks:
            rank.close()
