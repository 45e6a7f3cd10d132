"""cuda_ext.layouts and the CPU copier: every engine layout and KV dtype round
trips byte-exact through real shm slots, with random block ids and TP ranks
writing disjoint shards; equivalent layouts give identical slot bytes; bad
input raises before a byte moves."""

from __future__ import annotations

import numpy as np
import pytest
from shm_helpers import checked_prefix

from shm import copy as shm_copy
from shm.layout import BlockLayout
from shm.pool import ShmPool

torch = pytest.importorskip("torch")

from kv_helpers import (  # noqa: E402
    BLOCKS,
    DIM,
    DTYPES,
    HEADS,
    LAYERS,
    TOKENS,
    engine_kv,
    expected_shard,
    logical_kv,
    raw,
)

from cuda_ext.copier import CpuBlockCopier, StagedBlockCopier  # noqa: E402
from cuda_ext.layouts import LAYOUTS, as_planes, kv_planes  # noqa: E402

SENTINEL = 0xAB


@pytest.fixture
def pool():
    with checked_prefix("cudaext") as prefix, ShmPool.create(prefix, 1 << 20) as created:
        created.segment_view(0)[:] = SENTINEL
        yield created


def make_copier(kind: str, planes, pool, impl: str):
    """The CPU copier, or the staged one (the fallback for CUDA planes without
    libkvcopy.so), whose gather / scatter logic runs the same on CPU planes."""
    return (CpuBlockCopier if kind == "cpu" else StagedBlockCopier)(planes, pool, impl=impl)


@pytest.mark.parametrize("kind", ["cpu", "staged"])
@pytest.mark.parametrize("impl", shm_copy.IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips_byte_exact_with_tp_shards(pool, layout, dtype, impl, kind):
    tp = 2
    kvs = [logical_kv(dtype, seed=10 * rank + 1) for rank in range(tp)]
    engines = [engine_kv(layout, kv) for kv in kvs]
    planes = [kv_planes(engine, layout) for engine in engines]
    block_layout = planes[0].block_layout(tp)
    assert block_layout.shard_bytes == LAYERS * 2 * TOKENS * HEADS * DIM * dtype.itemsize
    rng = np.random.default_rng(10 * LAYOUTS.index(layout) + DTYPES.index(dtype))
    blocks = rng.permutation(BLOCKS)[:7]
    slots = rng.permutation(pool.num_slots(block_layout.slot_stride))[:7]
    for rank in range(tp):
        copier = make_copier(kind, planes[rank], pool, impl)
        copier.save(blocks, slots, block_layout, rank).synchronize()
    for block, slot in zip(blocks, slots, strict=True):
        view = pool.slot_view(int(slot), block_layout.slot_stride)
        shards = [expected_shard(kv, int(block)) for kv in kvs]
        assert np.array_equal(view[: block_layout.block_bytes], np.concatenate(shards))
        assert (view[block_layout.block_bytes :] == SENTINEL).all()
    targets = rng.permutation(BLOCKS)[:7]
    for rank in range(tp):
        back = engine_kv(layout, torch.zeros_like(kvs[rank]))
        back_planes = kv_planes(back, layout)
        with make_copier(kind, back_planes, pool, impl) as copier:
            copier.load(targets, slots, block_layout, rank).wait_layer(LAYERS - 1)
        for target, block in zip(targets, blocks, strict=True):
            got = np.concatenate([raw(p[int(target)]) for p in back_planes.planes])
            assert np.array_equal(got, expected_shard(kvs[rank], int(block)))
        untouched = np.setdiff1d(np.arange(BLOCKS), targets)
        assert not any(raw(p[torch.as_tensor(untouched)]).any() for p in back_planes.planes)


def test_planes_are_views_of_the_engine_memory():
    kv = engine_kv("vllm_flash", logical_kv(torch.bfloat16, seed=3))
    planes = kv_planes(kv, "vllm_flash")
    assert planes.layer_ends == (2, 4, 6) and planes.num_layers == LAYERS
    assert planes.dtype == torch.bfloat16 and planes.num_blocks == BLOCKS
    assert planes.chunk_bytes == TOKENS * HEADS * DIM * 2
    assert [p.data_ptr() for p in as_planes(kv, "vllm_flash")] == [
        t[half].data_ptr() for t in kv for half in (0, 1)
    ]
    planes.planes[3][5] = 7  # layer 1, V, block 5
    assert (kv[1][1, 5].view(torch.uint8) == 7).all()
    cross = kv_planes(engine_kv("cross_layer", logical_kv(torch.float16, seed=4)), "cross_layer")
    assert cross.layer_ends == (1, 1, 1) and len(cross.planes) == 1
    assert kv_planes(kv, "paged").layout == "block_major"


@pytest.mark.parametrize(
    "kv, layout, error, match",
    [
        (lambda: [torch.zeros(2, 4, 8)], "vllm", ValueError, "unknown KV layout"),
        (lambda: [torch.zeros(3, 4, 2, 2, 8)], "vllm_flash", ValueError, r"\[2, num_blocks"),
        (lambda: [torch.zeros(4, 3, 2, 2, 8)], "flashinfer", ValueError, r"\[num_blocks, 2"),
        (lambda: [torch.zeros(4, 2, 8, 1)], "mla", ValueError, "latent_dim"),
        (lambda: torch.zeros(4, 3, 2, 2, 8), "mla", TypeError, "not one tensor"),
        (lambda: [torch.zeros(4, 3, 8)] * 2, "cross_layer", ValueError, "one tensor"),
        (lambda: [], "block_major", TypeError, "non-empty"),
        (lambda: [torch.zeros(4, 8).t()], "block_major", ValueError, "contiguous"),
        (
            lambda: [torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.half)],
            "mla",
            ValueError,
            "tensor 1 is",
        ),
        (lambda: [torch.zeros(4, 8), torch.zeros(5, 8)], "block_major", ValueError, "tensor 0"),
        (lambda: [torch.zeros(0, 8)], "block_major", ValueError, "no blocks"),
        (lambda: [torch.zeros(4, 8), "x"], "block_major", TypeError, "not a torch.Tensor"),
        (lambda: [torch.zeros(4, 2, dtype=torch.bool)], "block_major", ValueError, "dtype"),
    ],
)
def test_bad_kv_is_rejected_with_a_clear_error(kv, layout, error, match):
    with pytest.raises(error, match=match):
        kv_planes(kv(), layout)


@pytest.mark.parametrize("kind", ["cpu", "staged"])
def test_bad_requests_raise_and_copy_nothing(pool, kind):
    kv = engine_kv("flashinfer", logical_kv(torch.float16, seed=5))
    before = [layer.clone() for layer in kv]
    planes = kv_planes(kv, "flashinfer")
    layout = planes.block_layout(2)
    copier = make_copier(kind, planes, pool, None)
    cases = [
        (([0, BLOCKS], [0, 1], layout, 0), ValueError, "block id out of range"),
        (([-1], [0], layout, 0), ValueError, "block id out of range"),
        (([0, 1], [3, 3], layout, 0), ValueError, "slots repeat"),
        (([0, 1], [0], layout, 0), ValueError, "2 block ids but 1 slots"),
        (([0], [0], layout, 2), ValueError, "rank 2 out of range"),
        (([0], [0], layout, True), TypeError, "rank"),
        (([0], [10**6], layout, 0), ValueError, "slot out of range"),
        (([0.5], [0], layout, 0), TypeError, "integers"),
        (([0], [0], BlockLayout(6, planes.chunk_bytes), 0), ValueError, "6 planes"),
        (([0], [0], "layout", 0), TypeError, "BlockLayout"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            copier.save(*args)
    with pytest.raises(ValueError, match="block_ids repeat"):
        copier.load([1, 1], [0, 1], layout, 0)
    with pytest.raises(ValueError, match="block id out of range"):
        copier.load([0, BLOCKS], [0, 1], layout, 0)
    assert (pool.segment_view(0) == SENTINEL).all()
    for layer, old in zip(kv, before, strict=True):
        assert torch.equal(layer.view(torch.uint8), old.view(torch.uint8))


def test_a_load_launches_once_per_group_of_whole_layers_of_enough_bytes():
    """GpuBlockCopier's launch plan (no GPU needed): consecutive whole layers
    until a group holds load_group_bytes of the op, the rest in the last."""
    from types import SimpleNamespace

    from cuda_ext.gpu import GpuBlockCopier

    planes = kv_planes([torch.zeros(4, 2, 1024) for _ in range(5)], "block_major")
    assert planes.chunk_bytes == 8192 and planes.layer_ends == (1, 2, 3, 4, 5)

    def groups(group_bytes: int, n: int, layer_events: bool = True, kv=planes):
        copier = SimpleNamespace(copied_planes=kv, load_group_bytes=group_bytes, _group_cache={})
        ends, event_of_layer = GpuBlockCopier._groups(copier, layer_events, n)  # type: ignore[arg-type]
        return ends.tolist(), event_of_layer  # where each launch's planes end

    assert groups(0, 4) == ([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    assert groups(2 * 8192 * 4, 4) == ([2, 4, 5], [0, 0, 1, 1, 2])
    assert groups(3 * 8192 * 4, 4) == ([3, 5], [0, 0, 0, 1, 1])
    assert groups(1 << 30, 4) == ([5], [0] * 5)
    assert groups(0, 4, layer_events=False) == ([5], [0] * 5)
    cross = kv_planes(torch.zeros(4, 3, 2, 256), "cross_layer")  # every layer in one plane
    assert groups(0, 4, kv=cross) == ([1], [0, 0, 0])


@pytest.mark.parametrize("kind", ["cpu", "staged"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copies_split_at_layer_splits_give_the_whole_copy_s_bytes(pool, layout, kind):
    """Layer-wise: a save and a load in model-layer ranges, one range per
    split, write exactly what one copy of every layer does; a range that
    would cut a plane (a cross-layer block's) is refused before a byte moves."""
    kv = logical_kv(torch.float16, seed=5)
    planes = kv_planes(engine_kv(layout, kv), layout)
    block_layout = planes.block_layout()
    blocks, slots = np.array([3, 0, 5]), np.array([4, 1, 2])
    splits = planes.coalesced().layer_splits
    assert splits[-1] == LAYERS and (layout == "cross_layer") == (splits == (LAYERS,))
    with make_copier(kind, planes, pool, "c" if "c" in shm_copy.IMPLS else "torch") as copier:
        begin = 0
        for end in splits:
            copier.save(blocks, slots, block_layout, 0, layers=(begin, end)).synchronize()
            begin = end
        for block, slot in zip(blocks, slots, strict=True):
            view = pool.slot_view(int(slot), block_layout.slot_stride)
            assert np.array_equal(view[: block_layout.block_bytes], expected_shard(kv, int(block)))
        back = engine_kv(layout, torch.zeros_like(kv))
        back_planes = kv_planes(back, layout)
    with make_copier(kind, back_planes, pool, "c" if "c" in shm_copy.IMPLS else "torch") as copier:
        begin = 0
        for end in splits:
            copier.load(np.array([7, 8, 9]), slots, block_layout, 0, layers=(begin, end))
            begin = end
        for target, block in zip([7, 8, 9], blocks, strict=True):
            got = np.concatenate([raw(p[target]) for p in back_planes.planes])
            assert np.array_equal(got, expected_shard(kv, int(block)))
        if splits == (LAYERS,):
            before = pool.segment_view(0).copy()
            with pytest.raises(ValueError, match="share planes with other layers"):
                copier.save(blocks, slots, block_layout, 0, layers=(0, 1))
            assert np.array_equal(pool.segment_view(0), before)
        with pytest.raises(ValueError, match="layers must be"):
            copier.load(blocks, slots, block_layout, 0, layers=(1, 1))
