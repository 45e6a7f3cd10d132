"""vLLM 0.33's KV cache layouts through cuda_ext's "strided" layout on CPU:
every KVCacheLayout (layer-compact, head-outer LHBNC, cross-layer BL*/BHLNC),
with and without padded pages, fp32 and bf16, through the CPU copier (the C
shm copier and the torch loop) and the staged copier (the torch fallback for
CUDA planes, run on CPU planes): saves write exactly the bytes plain
indexing gives, loads put them back into other blocks, and padding and
untouched blocks keep their bytes. The same with CUDA tensors through
GpuBlockCopier's two paths (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from shm_helpers import checked_prefix

from shm import copy as shm_copy
from shm.pool import ShmPool

torch = pytest.importorskip("torch")

from kv_helpers import (  # noqa: E402
    FILL,
    VLLM_ORDERS,
    padding_mask,
    random_bytes,
    raw,
    vllm_block_bytes,
    vllm_shard,
    vllm_views,
    why_no_gpu,
)

from cuda_ext.copier import CpuBlockCopier, StagedBlockCopier  # noqa: E402
from cuda_ext.layouts import kv_planes  # noqa: E402
from cuda_ext.runs import block_runs  # noqa: E402

LAYERS, BLOCKS, TOKENS, DIM = 3, 10, 4, 8
SENTINEL = 0xAB
NEEDS_GPU = pytest.mark.skipif(why_no_gpu() is not None, reason=str(why_no_gpu()))
HEADS_OUTSIDE = ("LHBNC", "BHLNC")
"""Layouts whose heads lie outside the block: a run per head."""


def cases() -> list[tuple[str, int, bool]]:
    """(layout, heads, padded): vLLM pads pages only where nothing but layers
    and blocks lie outside a page, so head-outer layouts pad with one head."""
    found = []
    for layout in VLLM_ORDERS:
        found.append((layout, 2, False))
        found.append((layout, 1 if layout in HEADS_OUTSIDE else 2, True))
    return found


def logical(heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[L, B, H, N, C] with C = K and V of one head (2 * DIM)."""
    gen = torch.Generator().manual_seed(seed)
    return random_bytes((LAYERS, BLOCKS, heads, TOKENS, 2 * DIM), dtype, gen)


def padded_page(heads: int, padded: bool) -> int | None:
    return heads * TOKENS * 2 * DIM + 24 if padded else None


@pytest.fixture
def pool():
    with checked_prefix("vllmlay") as prefix, ShmPool.create(prefix, 1 << 20) as created:
        created.segment_view(0)[:] = SENTINEL
        yield created


@pytest.mark.parametrize("kind", ["cpu", "staged"])
@pytest.mark.parametrize("impl", shm_copy.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout, heads, padded", cases())
def test_every_vllm_layout_round_trips_byte_exact(pool, layout, heads, padded, dtype, impl, kind):
    tp, pad = 2, padded_page(heads, padded)
    kvs = [logical(heads, dtype, seed=5 * rank + 1) for rank in range(tp)]
    engines = [vllm_views(kv, layout, pad)[1] for kv in kvs]
    planes = [kv_planes(views, "strided") for views in engines]
    block_layout = planes[0].block_layout(tp)
    assert block_layout.shard_bytes == LAYERS * heads * TOKENS * 2 * DIM * dtype.itemsize
    rng = np.random.default_rng(list(VLLM_ORDERS).index(layout) + 10 * heads + 100 * padded)
    blocks = rng.permutation(BLOCKS)[:6]
    slots = rng.permutation(pool.num_slots(block_layout.slot_stride))[:6]
    copier_class = CpuBlockCopier if kind == "cpu" else StagedBlockCopier
    for rank in range(tp):
        copier_class(planes[rank], pool, impl=impl).save(blocks, slots, block_layout, rank)
    for block, slot in zip(blocks.tolist(), slots.tolist(), strict=True):
        view = pool.slot_view(slot, block_layout.slot_stride)
        shards = [vllm_shard(kv, layout, block) for kv in kvs]
        assert np.array_equal(view[: block_layout.block_bytes], np.concatenate(shards))
        assert (view[block_layout.block_bytes :] == SENTINEL).all()

    targets = rng.permutation(BLOCKS)[:6]
    for rank in range(tp):
        memory, back = vllm_views(torch.zeros_like(kvs[rank]), layout, pad)
        padding = padding_mask(memory, back).bool()
        copier = copier_class(kv_planes(back, "strided"), pool, impl=impl)
        copier.load(targets, slots, block_layout, rank).wait_layer(LAYERS - 1)
        for target, block in zip(targets.tolist(), blocks.tolist(), strict=True):
            for layer in range(LAYERS):  # plain indexing of the engine's own views
                got = raw(back[layer][target])
                assert np.array_equal(got, raw(kvs[rank][layer, block]))
        untouched = np.setdiff1d(np.arange(BLOCKS), targets)
        assert not any(raw(v[torch.as_tensor(untouched)]).any() for v in back)
        assert (memory.view(torch.uint8)[padding] == FILL).all()
        assert bool(padding.any()) == padded


@pytest.mark.parametrize("layout, heads, padded", cases())
def test_planes_follow_the_layout_and_cross_layer_blocks_copy_as_one_chunk(layout, heads, padded):
    pad = padded_page(heads, padded)
    kv = logical(heads, torch.bfloat16, seed=3)
    _, views = vllm_views(kv, layout, pad)
    planes = kv_planes(views, "strided")
    runs = heads if layout in HEADS_OUTSIDE and heads > 1 else 1
    page = heads * TOKENS * 2 * DIM * 2
    assert len(planes.planes) == LAYERS * runs and planes.chunk_bytes == page // runs
    assert planes.layer_ends == tuple(runs * (i + 1) for i in range(LAYERS))
    assert planes.num_layers == LAYERS and planes.dtype == torch.bfloat16
    for i, plane in enumerate(planes.planes):  # views of the engine's memory, never copies
        layer, run = divmod(i, runs)
        first = views[layer][3] if runs == 1 else views[layer][3, run]
        assert plane[3].data_ptr() == first.data_ptr()
    coalesced = planes.coalesced()
    cross_layer = layout.startswith("BL") and not padded
    assert len(coalesced.planes) == (1 if cross_layer else LAYERS * runs)
    assert coalesced.chunk_bytes * len(coalesced.planes) == LAYERS * page
    assert coalesced.block_layout(2).shard_bytes == planes.block_layout(2).shard_bytes
    if cross_layer:
        assert coalesced.layer_ends == (1,) * LAYERS
        whole = raw(coalesced.planes[0][7])
        assert np.array_equal(whole, vllm_shard(kv, layout, 7))
    if padded:
        assert set(planes.block_strides) == {pad * 2 * (LAYERS if layout.startswith("B") else 1)}


def test_block_runs_of_a_head_outer_layer_are_its_heads():
    kv = logical(3, torch.float32, seed=4)
    _, views = vllm_views(kv, "LHBNC")
    runs = block_runs(views[1])
    assert len(runs) == 3 and runs[0].shape == (BLOCKS, TOKENS * 2 * DIM)
    for head, run in enumerate(runs):
        assert np.array_equal(raw(run[5]), raw(kv[1, 5, head]))
    assert np.array_equal(
        np.concatenate([raw(run[5]) for run in runs]), vllm_block_bytes(kv, "LHBNC", 1, 5)
    )


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda t: [t[..., ::2]], "no contiguous innermost"),
        (lambda t: [t[:, :1].expand(4, 2, 16)], "same memory"),
        (lambda t: [t, t], "share memory"),
        (lambda t: [t[:, 0], t.view(-1)[8:].as_strided((4, 16), (32, 1))], "share memory"),
        (lambda t: [t, t.transpose(1, 2).contiguous().transpose(1, 2)], "share their strides"),
        (lambda t: [t[:0]], "no blocks"),
    ],
)
def test_strided_kv_that_cannot_be_copied_is_refused(make, match):
    t = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match=match):
        kv_planes(make(t), "strided")


def test_planes_of_one_allocation_that_interleave_without_sharing_are_accepted():
    memory = torch.zeros(4, 2, 16)  # blocks of two layers, interleaved: cross-layer
    planes = kv_planes([memory[:, 0], memory[:, 1]], "strided")
    assert planes.block_strides == (128, 128) and len(planes.coalesced().planes) == 1
    shifted = memory.view(-1)[8:].as_strided((4, 16), (32, 1))  # straddles both layers
    with pytest.raises(ValueError, match="share memory"):
        kv_planes([memory[:, 0], shifted], "strided")


def test_a_padded_cross_layer_tensor_copies_only_its_payload(pool):
    memory = torch.full((BLOCKS, LAYERS * 64 + 16), -1.0)
    kv = memory[:, : LAYERS * 64].view(BLOCKS, LAYERS, 64)  # padded blocks
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view_as(kv))
    planes = kv_planes(kv, "cross_layer")
    assert planes.block_strides == ((LAYERS * 64 + 16) * 4,)
    layout = planes.block_layout()
    CpuBlockCopier(planes, pool).save([2, 7], [0, 1], layout, 0)
    back_memory = torch.full_like(memory, -1.0)
    back = back_memory[:, : LAYERS * 64].view(BLOCKS, LAYERS, 64)
    CpuBlockCopier(kv_planes(back, "cross_layer"), pool).load([4, 1], [0, 1], layout, 0)
    assert torch.equal(back[4], kv[2]) and torch.equal(back[1], kv[7])
    assert (back_memory[:, LAYERS * 64 :] == -1).all()
    assert (back[[0, 2, 3, 5, 6, 7, 8, 9]] == -1).all()


@NEEDS_GPU
@pytest.mark.parametrize("path", ["sm", "dma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout, heads, padded", cases())
def test_every_vllm_layout_round_trips_byte_exact_on_the_gpu(
    pool, layout, heads, padded, dtype, path
):
    from cuda_ext.gpu import GpuBlockCopier

    tp, pad = 2, padded_page(heads, padded)
    kvs = [logical(heads, dtype, seed=5 * rank + 2) for rank in range(tp)]
    planes = [kv_planes(vllm_views(kv.cuda(), layout, pad)[1], "strided") for kv in kvs]
    block_layout = planes[0].block_layout(tp)
    rng = np.random.default_rng(list(VLLM_ORDERS).index(layout) + 10 * heads + 100 * padded)
    blocks = rng.permutation(BLOCKS)[:6]
    slots = rng.permutation(pool.num_slots(block_layout.slot_stride))[:6]
    for rank in range(tp):
        with GpuBlockCopier(planes[rank], pool, path=path) as copier:
            copier.save(blocks, slots, block_layout, rank).synchronize()
    for block, slot in zip(blocks.tolist(), slots.tolist(), strict=True):
        view = pool.slot_view(slot, block_layout.slot_stride)
        shards = [vllm_shard(kv, layout, block) for kv in kvs]
        assert np.array_equal(view[: block_layout.block_bytes], np.concatenate(shards))
    targets = rng.permutation(BLOCKS)[:6]
    for rank in range(tp):
        memory, back = vllm_views(torch.zeros_like(kvs[rank]).cuda(), layout, pad)
        padding = padding_mask(memory, back).bool().cuda()
        with GpuBlockCopier(kv_planes(back, "strided"), pool, path=path) as copier:
            copier.load(targets, slots, block_layout, rank).synchronize()
        for target, block in zip(targets.tolist(), blocks.tolist(), strict=True):
            for layer in range(LAYERS):
                assert np.array_equal(raw(back[layer][target]), raw(kvs[rank][layer, block]))
        untouched = torch.as_tensor(np.setdiff1d(np.arange(BLOCKS), targets), device="cuda")
        assert not any(v[untouched].view(torch.uint8).any() for v in back)
        assert (memory.view(torch.uint8)[padding] == FILL).all()


@NEEDS_GPU
def test_on_the_gpu_a_cross_layer_block_is_one_chunk_and_odd_strides_take_dma(pool):
    from cuda_ext.gpu import GpuBlockCopier

    kv = logical(2, torch.bfloat16, seed=9).cuda()
    with GpuBlockCopier(kv_planes(vllm_views(kv, "BLHNC")[1], "strided"), pool) as copier:
        assert len(copier.copied_planes.planes) == 1 and copier.sm_capable
    odd = TOKENS * 2 * 2 * DIM + 2  # a padded page of 4-byte elements, 8 bytes past 16
    planes = kv_planes(vllm_views(kv.float(), "LBHNC", odd)[1], "strided")
    with GpuBlockCopier(planes, pool) as copier:
        assert not copier.sm_capable and copier.choose_path() == "dma"
        layout = planes.block_layout()
        copier.save([4, 1], [0, 2], layout, 0).synchronize()
        view = pool.slot_view(2, layout.slot_stride)[: layout.block_bytes]
        assert np.array_equal(view, vllm_shard(kv.float(), "LBHNC", 1))


@pytest.mark.parametrize("max_pairs", [None, 0])
def test_planes_are_checked_disjoint_pair_by_pair_or_by_offsets(monkeypatch, max_pairs):
    """Past MAX_PAIRS candidate pairs, the planes' offsets within one block
    stride are checked instead: the same verdicts for these layouts."""
    from cuda_ext import runs

    if max_pairs is not None:
        monkeypatch.setattr(runs, "MAX_PAIRS", max_pairs)
    kv = logical(3, torch.float32, seed=6)
    for layout in ("BHLNC", "BLHNC", "BLNHC"):
        kv_planes(vllm_views(kv, layout)[1], "strided")  # interleaved, never shared
    memory = torch.zeros(BLOCKS, 2, 64)
    shifted = memory.view(-1)[32:].as_strided((BLOCKS - 1, 64), (128, 1))
    with pytest.raises(ValueError, match="share memory"):
        kv_planes([memory[:-1, 0], shifted], "strided")
