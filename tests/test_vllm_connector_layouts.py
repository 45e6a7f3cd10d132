"""The vLLM connector's worker path in every vLLM 0.33 KV cache layout, against
a real sidecar process: one engine saves a request's blocks from vLLM-shaped
`[B, H, N, C]` views of its layout (padded pages included), another engine
loads them into other blocks, byte for byte as plain indexing of the views
says, its padding and other blocks untouched; the scheduler's stand-in
registers into the workers' namespace (its lookups hit). On CPU tensors here,
on CUDA tensors where a GPU is (skipped otherwise)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from kv_helpers import FILL, VLLM_ORDERS, padding_mask, random_bytes, raw, vllm_views, why_no_gpu
from sidecar_proc import Sidecar
from test_vllm_connector import finished_eventually, save, step
from vllm_helpers import BLOCK, StepOutput, prompt, request, scheduler_side, settings, tables_of

from cuda_ext.layouts import kv_planes
from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.worker import WorkerSide

LAYERS, NUM_BLOCKS, DIM = 2, 12, 8
HEADS_OUTSIDE = ("LHBNC", "BHLNC")
CASES = [
    (layout, heads, padded)
    for layout in VLLM_ORDERS
    for heads, padded in ((2, False), (1 if layout in HEADS_OUTSIDE else 2, True))
]


@pytest.fixture(scope="module")
def sidecar():
    s = Sidecar(capacity="8MiB").start()
    yield s
    try:
        assert s.stop() == 0
        assert s.shm_segments() == [], "shm segments outlived the sidecar"
    finally:
        s.cleanup()


def geometry(layout: str, heads: int, dtype: torch.dtype) -> KVGeometry:
    return KVGeometry(layout, num_layers=LAYERS, block_size=BLOCK, num_kv_heads=heads,
                      head_dim=DIM, dtype=dtype, block_elems=heads * BLOCK * 2 * DIM)  # fmt: skip


def engine(layout: str, kv: torch.Tensor, padded: bool):
    """(the allocation, vLLM's {layer name: view}) of `kv` ([L, B, H, N, C])."""
    page = kv.shape[2] * BLOCK * 2 * DIM
    memory, views = vllm_views(kv, layout, page + 8 if padded else None)
    return memory, {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}


def hooked_step(sched, worker: WorkerSide, scheduled: dict[str, int], names: list[str]) -> None:
    """One step whose forward runs the per-layer hooks, in layer order."""
    meta = sched.build_meta(StepOutput(scheduled))
    worker.start_loads(meta)
    for name in names:
        worker.wait_for_layer(name)
        worker.save_layer(meta, name)
    worker.run_saves(meta)


def run_case(
    sidecar, layout: str, heads: int, padded: bool, dtype, device: str, layer_wise: bool = False
) -> None:
    geo = geometry(layout, heads, dtype)
    gen = torch.Generator().manual_seed(7)
    kv = random_bytes((LAYERS, NUM_BLOCKS, heads, BLOCK, 2 * DIM), dtype, gen)
    _, saved = engine(layout, kv.to(device), padded)
    memory, loaded = engine(layout, torch.zeros_like(kv, device=device), padded)
    padding = padding_mask(memory, list(loaded.values())).bool().to(device)
    stand_in = kv_planes(geo.stand_in(), "strided")
    engine_planes = kv_planes(geo.planes(saved), "strided")
    assert (len(stand_in.planes), stand_in.chunk_bytes) == (
        len(engine_planes.planes),
        engine_planes.chunk_bytes,
    )
    made = []
    try:
        name = f"m-{layout}-{dtype}-{layer_wise}"
        layered = {"layer_wise": True, "load_async": False} if layer_wise else {}
        writer = WorkerSide(settings(sidecar.endpoint, model_name=name, **layered), geo)
        made.append(writer)
        writer.register(saved)
        sched = scheduler_side(writer.settings, geometry=geo)
        made.append(sched)
        tokens = prompt(3 * BLOCK + 1, start=heads + 10 * padded)
        names = list(saved)
        if layer_wise:
            first = request("a", tokens)
            tables_of(sched)["a"] = [3, 7, 1, 5]
            sched.after_alloc(first, [3, 7, 1, 5], 0)
            hooked_step(sched, writer, {"a": len(tokens)}, names)
            first.num_computed_tokens = len(tokens)
            assert sched.finished(first) is True
            hooked_step(sched, writer, {}, names)
            assert finished_eventually(writer) == ({"a"}, set())
        else:
            save(sched, writer, request("a", tokens), [3, 7, 1, 5])

        another_engine = dataclasses.replace(writer.settings, engine_id="reader")
        reader = WorkerSide(another_engine, geo)
        made.append(reader)
        reader.register(loaded)
        second = request("b", tokens)
        assert sched.num_new_matched_tokens(second, 0) == (3 * BLOCK, not layer_wise)
        tables_of(sched)["b"] = [9, 0, 4, 2]
        sched.after_alloc(second, [9, 0, 4, 2], 3 * BLOCK)
        if layer_wise:  # a synchronous load, layer by layer in the forward
            hooked_step(sched, reader, {"b": 1}, names)
            assert reader.finished() == (set(), set()) and reader.load_errors() == set()
        else:
            step(sched, reader, {"b": 1})
            assert finished_eventually(reader) == (set(), {"b"}) and reader.load_errors() == set()
    finally:
        for side in made:
            side.close()
    views = list(loaded.values())
    for target, source in ((9, 3), (0, 7), (4, 1)):
        for layer in range(LAYERS):
            assert np.array_equal(raw(views[layer][target]), raw(kv[layer, source]))
    for other in (1, 2, 3, 5, 6, 7, 8, 10, 11):
        assert not any(v[other].view(torch.uint8).any() for v in views)
    assert (memory.view(torch.uint8)[padding] == FILL).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout, heads, padded", CASES)
def test_every_layout_saves_and_loads_through_the_connector(sidecar, layout, heads, padded, dtype):
    run_case(sidecar, layout, heads, padded, dtype, "cpu")


@pytest.mark.parametrize("layout, heads, padded", CASES)
def test_every_layout_saves_and_loads_layer_by_layer(sidecar, layout, heads, padded):
    """layer_wise: saves copied as the forward computes each layer, loads
    synchronous and copied split by split (a cross-layer block whole)."""
    run_case(sidecar, layout, heads, padded, torch.bfloat16, "cpu", layer_wise=True)


@pytest.mark.skipif(why_no_gpu() is not None, reason=str(why_no_gpu()))
@pytest.mark.parametrize("layer_wise", [False, True], ids=["per-step", "layer-wise"])
@pytest.mark.parametrize("layout, heads, padded", CASES)
def test_every_layout_saves_and_loads_cuda_tensors_through_the_connector(
    sidecar, layout, heads, padded, layer_wise
):
    run_case(sidecar, layout, heads, padded, torch.bfloat16, "cuda", layer_wise=layer_wise)


@pytest.mark.parametrize("layout", VLLM_ORDERS)
def test_views_of_another_layout_are_refused(layout):
    kv = torch.zeros(LAYERS, NUM_BLOCKS, 2, BLOCK, 2 * DIM)
    wrong = "LBNHC" if layout != "LBNHC" else "LBHNC"
    _, views = engine(wrong, kv, padded=False)
    geo = geometry(layout, 2, torch.float32)
    # Layer-compact and cross-layer views of one page order lay a block's
    # bytes out alike (only the block stride differs): those copy the same.
    if {layout, wrong} in ({"LBHNC", "BLHNC"}, {"LBNHC", "BLNHC"}):
        assert len(geo.planes(views)) == LAYERS
    else:
        with pytest.raises(ValueError, match=f"not a {layout} view"):
            geo.planes(views)


def test_kernel_blocks_regroup_or_are_refused_where_they_reorder_a_block():
    """Views in kernel blocks of BLOCK / 2 tokens: LBNHC's two make a block
    laid out as an unsplit engine's; LBHNC's would not, so they are refused."""
    half = BLOCK // 2
    lbnhc = torch.zeros(2 * NUM_BLOCKS, half, 2, 2 * DIM).permute(0, 2, 1, 3)
    geo = geometry("LBNHC", 2, torch.float32)
    planes = kv_planes(geo.planes({"a": lbnhc, "b": lbnhc.clone()}), "strided")
    assert planes.num_blocks == NUM_BLOCKS and planes.chunk_bytes == geo.block_elems * 4
    lbhnc = torch.zeros(2 * NUM_BLOCKS, 2, half, 2 * DIM)
    with pytest.raises(ValueError, match="kernels split"):
        geometry("LBHNC", 2, torch.float32).planes({"a": lbhnc, "b": lbhnc.clone()})
