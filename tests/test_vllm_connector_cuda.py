"""The worker side's CUDA path: the transfer thread's own stream, ordered
after the forward's stream by the event `wait_for_save` records, with KV
tensors on the GPU (fp32 and bf16). Skipped without CUDA.

What is checked: a save queued right after KV was written on the current
stream (not synchronized) stores what was written; the blocks then load,
asynchronously and synchronously layer by layer, byte for byte.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

from sidecar_proc import DEADLINE, Sidecar
from vllm_helpers import (
    BLOCK,
    GEOMETRY,
    NUM_BLOCKS,
    StepOutput,
    prompt,
    request,
    scheduler_side,
    settings,
    tables_of,
)

from engine_shim.kvconnector.worker import WorkerSide


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="64MiB").start()
    yield s
    s.cleanup()


def cuda_kv(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, GEOMETRY.num_kv_heads, 2 * GEOMETRY.head_dim)
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype, device="cuda").permute(
            0, 2, 1, 3
        )
        for i in range(GEOMETRY.num_layers)
    }


def finished_eventually(worker: WorkerSide) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + DEADLINE
    while not any(got := worker.finished()):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return got


@pytest.mark.parametrize("layer_wise", [False, True], ids=["per-step", "layer-wise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("load_async", [True, False])
def test_saves_follow_the_forward_stream_and_load_back_exactly(
    sidecar, dtype, load_async, layer_wise
):
    """Layer-wise: each layer's save is queued right after the layer's
    writes (an event per layer), the load's layers waited for one by one."""
    geometry = dataclasses.replace(GEOMETRY, dtype=dtype)
    s = settings(sidecar.endpoint, load_async=load_async, layer_wise=layer_wise)
    kv = cuda_kv(dtype)
    worker = WorkerSide(s, geometry)
    worker.register(kv)
    sched = scheduler_side(s, geometry=geometry)
    try:
        tokens = prompt(3 * BLOCK + 1, start=11)
        req = request("a", tokens)
        tables_of(sched)["a"] = [0, 1, 2, 3]
        sched.after_alloc(req, [0, 1, 2, 3], 0)
        # The "forward": its KV writes come after matmuls long enough to be
        # still queued on the current stream when the save is.
        meta = sched.build_meta(StepOutput({"a": len(tokens)}))
        worker.start_loads(meta)
        big = torch.randn(2048, 2048, device="cuda")
        for i, (name, t) in enumerate(kv.items()):
            for _ in range(8):
                big = torch.tanh(big @ big)  # bounded: no inf, so 0 * big is 0
            zero = (big[0, 0] * 0).to(dtype)  # the writes depend on the matmuls
            values = torch.arange(t[:3].numel(), device="cuda").reshape(t[:3].shape) % 251 + i
            t[:3] = values.to(dtype) + zero
            worker.save_layer(meta, name)  # layer-wise: this layer's copy, after its writes
        want = [t[:3].clone() for t in kv.values()]
        worker.run_saves(meta)  # no synchronize: the copy must wait for the writes
        req.num_computed_tokens = len(tokens)
        assert sched.finished(req) is True
        worker.run_saves(sched.build_meta(StepOutput()))
        assert finished_eventually(worker) == ({"a"}, set())

        other = request("b", tokens)
        deadline = time.monotonic() + DEADLINE
        while (hit := sched.num_new_matched_tokens(other, 0))[0] is None:
            assert time.monotonic() < deadline
        assert hit == (3 * BLOCK, load_async)
        tables_of(sched)["b"] = [10, 11, 12, 13]
        sched.after_alloc(other, [10, 11, 12, 13], 3 * BLOCK)
        meta = sched.build_meta(StepOutput())
        worker.start_loads(meta)
        if load_async:
            assert finished_eventually(worker) == (set(), {"b"})
        else:
            for name in kv:
                worker.wait_for_layer(name)  # the current stream waits per layer
            worker.run_saves(meta)
        assert worker.load_errors() == set()
        torch.cuda.current_stream().synchronize()
        for got, expected in zip((t[10:13] for t in kv.values()), want, strict=True):
            assert torch.equal(got, expected)
    finally:
        sched.close()
        worker.close()
