"""GpuBlockCopier on a real GPU (skipped without one): both copy paths give
exactly the bytes of the CPU path for every layout and dtype, with random
block ids and TP shards; bad ids are rejected before any launch; per-layer
events complete in layer order; the pool is registered once per process."""

from __future__ import annotations

import time

import numpy as np
import pytest
from shm_helpers import checked_prefix

from shm.pool import ShmPool

torch = pytest.importorskip("torch")

from kv_helpers import (  # noqa: E402
    BLOCKS,
    DTYPES,
    LAYERS,
    engine_kv,
    expected_shard,
    logical_kv,
    raw,
    why_no_gpu,
)

from cuda_ext import _lib, gpu, gpu_handle  # noqa: E402
from cuda_ext.gpu import GpuBlockCopier  # noqa: E402
from cuda_ext.layouts import LAYOUTS, kv_planes  # noqa: E402

pytestmark = pytest.mark.skipif(why_no_gpu() is not None, reason=str(why_no_gpu()))
SENTINEL = 0xAB


@pytest.fixture
def pool():
    with checked_prefix("cudagpu") as prefix, ShmPool.create(prefix, 1 << 20) as created:
        created.segment_view(0)[:] = SENTINEL
        yield created


def gpu_planes(layout: str, kv: torch.Tensor):
    return kv_planes(engine_kv(layout, kv.cuda()), layout)


@pytest.mark.parametrize("path", ["sm", "dma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_byte_exact_for_every_layout_and_dtype(pool, layout, dtype, path):
    tp = 2
    kvs = [logical_kv(dtype, seed=7 * rank + 3) for rank in range(tp)]
    planes = [gpu_planes(layout, kv) for kv in kvs]
    block_layout = planes[0].block_layout(tp)
    rng = np.random.default_rng(10 * LAYOUTS.index(layout) + DTYPES.index(dtype))
    blocks = rng.permutation(BLOCKS)[:7]
    slots = rng.permutation(pool.num_slots(block_layout.slot_stride))[:7]
    for rank in range(tp):
        with GpuBlockCopier(planes[rank], pool, path=path) as copier:
            copier.save(blocks, slots, block_layout, rank).synchronize()
    for block, slot in zip(blocks, slots, strict=True):
        view = pool.slot_view(int(slot), block_layout.slot_stride)
        shards = [expected_shard(kv, int(block)) for kv in kvs]
        assert np.array_equal(view[: block_layout.block_bytes], np.concatenate(shards))
        assert (view[block_layout.block_bytes :] == SENTINEL).all()
    targets = rng.permutation(BLOCKS)[:7]
    for rank in range(tp):
        back = gpu_planes(layout, torch.zeros_like(kvs[rank]))
        with GpuBlockCopier(back, pool, path=path) as copier:
            copier.load(targets, slots, block_layout, rank).synchronize()
        for target, block in zip(targets, blocks, strict=True):
            got = np.concatenate([raw(p[int(target)]) for p in back.planes])
            assert np.array_equal(got, expected_shard(kvs[rank], int(block)))
        untouched = torch.as_tensor(np.setdiff1d(np.arange(BLOCKS), targets), device="cuda")
        assert not any(p[untouched].any() for p in back.planes)


def test_bad_ids_are_rejected_before_any_launch(pool):
    planes = gpu_planes("vllm_flash", logical_kv(torch.float16, seed=1))
    layout = planes.block_layout()
    with GpuBlockCopier(planes, pool) as copier:
        torch.cuda.synchronize()
        for blocks, slots in [([0, BLOCKS], [0, 1]), ([-1], [0]), ([0], [10**6])]:
            with pytest.raises(ValueError, match="out of range"):
                copier.save(blocks, slots, layout, 0)
            with pytest.raises(ValueError, match="out of range"):
                copier.load(blocks, slots, layout, 0)
        with pytest.raises(ValueError, match="slots repeat"):
            copier.save([0, 1], [2, 2], layout, 0)
        with pytest.raises(ValueError, match="block_ids repeat"):
            copier.load([3, 3], [0, 1], layout, 0)
        with pytest.raises(ValueError, match="rank"):
            copier.save([0], [0], layout, 1)
        with pytest.raises(ValueError, match="1-D"):
            copier.save([[0]], [[0]], layout, 0)
        assert copier.stream.query()
    assert (pool.segment_view(0) == SENTINEL).all()


def test_unaligned_chunks_take_the_dma_path(pool):
    kv = [torch.randint(0, 256, (BLOCKS, 6), dtype=torch.uint8, device="cuda") for _ in range(2)]
    planes = kv_planes(kv, "block_major")
    layout = planes.block_layout()
    with GpuBlockCopier(planes, pool) as copier:
        assert not copier.sm_capable and copier.choose_path() == "dma"
        with pytest.raises(ValueError, match="16"):
            copier.choose_path("sm")
        copier.save([3, 5], [1, 0], layout, 0).synchronize()
        view = pool.slot_view(1, layout.slot_stride)
        assert np.array_equal(view[:12], np.concatenate([raw(t[3]) for t in kv]))


def test_layer_events_complete_in_layer_order(pool):
    layers, blocks = 8, 32  # 64 KiB chunks, 32 MiB in all: long enough to watch
    shape = (2, blocks, 16, 8, 256)
    kv = [torch.randint(0, 256, shape, dtype=torch.int16).cuda() for _ in range(layers)]
    planes = kv_planes(kv, "vllm_flash")
    layout = planes.block_layout()
    with (
        checked_prefix("cudaevents") as prefix,
        ShmPool.create(prefix, blocks * layout.slot_stride) as big,
        GpuBlockCopier(planes, big, path="sm", load_group_bytes=0) as copier,
    ):
        ids = np.arange(blocks)
        copier.save(ids, ids, layout, 0).synchronize()
        saved = [t.cpu() for t in kv]
        for t in kv:
            t.zero_()
        handle = copier.load(ids, ids, layout, 0)
        seen = []
        deadline = time.monotonic() + 30
        while not handle.query() and time.monotonic() < deadline:
            seen.append([handle.query_layer(layer) for layer in range(layers)])
        assert len(handle._events) == layers
        for states in seen:  # done layers always form a prefix
            assert states == sorted(states, reverse=True), states
        other = torch.cuda.Stream()
        handle.wait_layer(0, other)
        with torch.cuda.stream(other):
            first = kv[0].clone()
        other.synchronize()
        assert torch.equal(first.cpu(), saved[0])
        handle.synchronize()
        # By default a launch covers whole layers of at least 16 MiB: 4 here.
        copier.load_group_bytes = gpu.LOAD_GROUP_BYTES
        for t in kv:
            t.zero_()
        handle = copier.load(ids, ids, layout, 0)
        assert len(handle._events) == 2 and handle._event_of_layer == [0] * 4 + [1] * 4
        handle.wait_layer(3, other)
        with torch.cuda.stream(other):
            early = [t.clone() for t in kv[:4]]
        other.synchronize()
        assert all(torch.equal(e.cpu(), want) for e, want in zip(early, saved, strict=False))
        handle.synchronize()
        assert all(torch.equal(t.cpu(), want) for t, want in zip(kv, saved, strict=True))
    cross = kv_planes(engine_kv("cross_layer", logical_kv(torch.bfloat16, 2).cuda()), "cross_layer")
    with GpuBlockCopier(cross, pool) as copier:
        handle = copier.load([0], [0], cross.block_layout(), 0)
        handle.wait_layer(LAYERS - 1)
        handle.synchronize()
        with pytest.raises(ValueError, match="layer"):
            handle.wait_layer(LAYERS)


def test_a_save_waits_for_work_queued_on_the_engine_stream(pool):
    planes = gpu_planes("flashinfer", logical_kv(torch.float16, seed=4))
    layout = planes.block_layout()
    with GpuBlockCopier(planes, pool) as copier:
        torch.cuda._sleep(100_000_000)  # ~0.1 s of GPU time ahead of the write
        planes.planes[0][2].fill_(7)
        copier.save([2], [0], layout, 0).synchronize()
        assert (pool.slot_view(0, layout.slot_stride)[: planes.chunk_bytes] == 7).all()


def test_ops_follow_the_callers_current_stream_and_empty_ops_complete(pool):
    """The op waits for what the engine queued on its own (non-default)
    stream; an op of no blocks still gives a handle that completes."""
    planes = gpu_planes("vllm_flash", logical_kv(torch.float16, seed=9))
    layout = planes.block_layout()
    engine = torch.cuda.Stream()
    with GpuBlockCopier(planes, pool) as copier, torch.cuda.stream(engine):
        torch.cuda._sleep(100_000_000)
        planes.planes[1][4].fill_(5)
        copier.save([4], [3], layout, 0).synchronize()
        start = layout.offset(0, 1)
        got = pool.slot_view(3, layout.slot_stride)[start : start + planes.chunk_bytes]
        assert (got == 5).all()
        for op in (copier.save, copier.load):
            handle = op([], [], layout, 0)
            handle.wait_layer(0)
            handle.synchronize()
            assert handle.query() and handle.query_layer(LAYERS - 1)
            with pytest.raises(ValueError, match="layer"):
                handle.query_layer(LAYERS)


def test_refused_ids_wait_for_nothing_and_change_nothing(pool):
    """Ids are checked before the op waits for a ring buffer or grows them
    (growing pins memory, which waits for the whole GPU): a bad op behind
    a long queued one is refused at once."""
    planes = gpu_planes("vllm_flash", logical_kv(torch.float16, seed=2))
    layout = planes.block_layout()
    work = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with GpuBlockCopier(planes, pool) as copier:
        for _ in range(100):  # ~0.1-0.2 s of GPU work before the save runs
            work = work @ work.T / 8192
        copier.save([1], [0], layout, 0)
        bad = np.full(3 * gpu.INDEX_MIN_ENTRIES, BLOCKS)  # would grow the index buffers
        start = time.monotonic()
        with pytest.raises(ValueError, match="out of range"):
            copier.save(bad, np.arange(bad.size), layout, 0)
        assert time.monotonic() - start < 0.05
        assert not copier.stream.query()  # the good save is still queued
    view = pool.slot_view(0, layout.slot_stride)
    assert np.array_equal(view[: planes.chunk_bytes], raw(planes.planes[0][1]))


def test_calls_leave_a_thread_without_a_cuda_context_without_one(pool):
    """libkvcopy puts back the calling thread's CUDA context exactly, none
    included, so it never starts a context on another GPU."""
    import ctypes
    import threading

    driver = ctypes.CDLL("libcuda.so.1")
    planes = gpu_planes("vllm_flash", logical_kv(torch.float16, seed=3))
    layout = planes.block_layout()
    contexts: list[int] = []
    done: list[bool] = []

    def current() -> int:
        context = ctypes.c_void_p(0)
        assert driver.cuCtxGetCurrent(ctypes.byref(context)) == 0
        return context.value or 0

    with GpuBlockCopier(planes, pool) as copier:
        handle = copier.save([2], [1], layout, 0)

        def probe() -> None:
            contexts.append(current())
            handle.synchronize()
            done.append(handle.query())
            contexts.append(current())
            copier.save([3], [2], layout, 0).synchronize()  # an op from this thread
            contexts.append(current())

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
    assert contexts == [0, 0, 0] and done == [True]


def test_close_while_another_thread_queues_ops_never_crashes(pool):
    import threading

    planes = gpu_planes("vllm_flash", logical_kv(torch.float16, seed=4))
    layout = planes.block_layout()
    copier = GpuBlockCopier(planes, pool)
    outcomes: list[str] = []

    def ops() -> None:
        for i in range(500):
            try:
                copier.save([i % BLOCKS], [0], layout, 0)
            except RuntimeError as err:
                outcomes.append(str(err))
                return
        outcomes.append("all ran")

    thread = threading.Thread(target=ops)
    thread.start()
    time.sleep(0.005)
    copier.close()
    thread.join()
    assert outcomes in (["the copier is closed"], ["all ran"])
    with pytest.raises(RuntimeError, match="closed"):
        copier.save([0], [0], layout, 0)


def test_ops_queued_back_to_back_each_copy_their_own_blocks(pool, monkeypatch):
    """More ops than the copier has pinned index buffers, all queued behind
    GPU work (so none has run when the buffers come round again), and one
    that outgrows them: every op copies the blocks it was given."""
    monkeypatch.setattr(gpu, "INDEX_MIN_ENTRIES", 2)  # one block per buffer
    source = gpu_planes("flashinfer", logical_kv(torch.float16, seed=6))
    target = gpu_planes("flashinfer", logical_kv(torch.float16, seed=8))
    layout = source.block_layout()
    saves = _lib.load().kv_index_ring() * 2 + 3
    assert saves + 3 <= pool.num_slots(layout.slot_stride)
    with GpuBlockCopier(source, pool) as copier:
        torch.cuda._sleep(50_000_000)
        for op in range(saves):
            copier.save([op % BLOCKS], [op], layout, 0)
        copier.save([1, 5, 9], [saves, saves + 1, saves + 2], layout, 0).synchronize()
    owners = [op % BLOCKS for op in range(saves)] + [1, 5, 9]
    for slot, block in enumerate(owners):
        view = pool.slot_view(slot, layout.slot_stride)
        for p, plane in enumerate(source.planes):
            start = layout.offset(0, p)
            got = view[start : start + layout.layer_block_bytes]
            assert np.array_equal(got, raw(plane[block])), (slot, block, p)
    with GpuBlockCopier(target, pool) as copier:
        torch.cuda._sleep(50_000_000)
        for block in range(BLOCKS):  # slot `block` holds source block `block`
            copier.load([block], [block], layout, 0)
        copier.load([0, 1, 2], [saves, saves + 1, saves + 2], layout, 0).synchronize()
    loaded = {block: block for block in range(3, BLOCKS)} | {0: 1, 1: 5, 2: 9}
    for block, origin in loaded.items():
        for s_plane, t_plane in zip(source.planes, target.planes, strict=True):
            assert np.array_equal(raw(t_plane[block]), raw(s_plane[origin])), (block, origin)


def test_the_pool_is_registered_once_per_process(pool):
    planes = gpu_planes("mla", logical_kv(torch.bfloat16, seed=5))
    first = GpuBlockCopier(planes, pool)
    second = GpuBlockCopier(planes, pool)
    address = pool.segment_view(0).ctypes.data
    entries = gpu_handle.REGISTRATIONS._entries
    assert [key[0] for key in entries].count(address) == 1
    assert entries[(address, pool.nbytes)][1] == 2
    first.close()
    second.save([0], [0], planes.block_layout(), 0).synchronize()
    second.close()
    second.close()
    assert (address, pool.nbytes) not in entries
    with pytest.raises(RuntimeError, match="closed"):
        second.save([0], [0], planes.block_layout(), 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_a_runnable_library_cuda_planes_take_the_staged_torch_path(
    pool, monkeypatch, layout
):
    from cuda_ext import _lib
    from cuda_ext.copier import StagedBlockCopier, open_copier

    def unavailable() -> int:
        raise _lib.GpuUnavailable("as with a driver older than the library's CUDA")

    monkeypatch.setattr(_lib, "probe", unavailable)
    kv = logical_kv(torch.bfloat16, seed=9)
    planes = gpu_planes(layout, kv)
    block_layout = planes.block_layout(1)
    blocks, slots = np.array([5, 2, 9]), np.array([4, 0, 7])
    with open_copier(planes, pool) as copier:
        assert isinstance(copier, StagedBlockCopier)
        copier.save(blocks, slots, block_layout, 0).synchronize()
    for block, slot in zip(blocks, slots, strict=True):
        view = pool.slot_view(int(slot), block_layout.slot_stride)
        assert np.array_equal(view[: block_layout.block_bytes], expected_shard(kv, int(block)))
    back = gpu_planes(layout, torch.zeros_like(kv))
    targets = np.array([1, 11, 3])
    with open_copier(back, pool) as copier:
        copier.load(targets, slots, block_layout, 0).wait_layer(LAYERS - 1)
    torch.cuda.current_stream().synchronize()
    for target, block in zip(targets, blocks, strict=True):
        got = np.concatenate([raw(p[int(target)]) for p in back.planes])
        assert np.array_equal(got, expected_shard(kv, int(block)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_ranges_give_the_whole_copy_s_bytes(pool, layout):
    """Layer-wise: ranges at `layer_splits` (the dma path, in one launch
    each) write and read exactly what one copy of every layer does, TP
    shards included; each range's handle waits for its own layers."""
    tp = 2
    kvs = [logical_kv(torch.bfloat16, seed=5 * rank + 1) for rank in range(tp)]
    planes = [gpu_planes(layout, kv) for kv in kvs]
    block_layout = planes[0].block_layout(tp)
    blocks, slots, targets = np.array([4, 0, 6]), np.array([3, 1, 5]), np.array([9, 2, 7])
    for rank in range(tp):
        with GpuBlockCopier(planes[rank], pool) as copier:
            splits, begin = copier.copied_planes.layer_splits, 0
            for end in splits:
                copier.save(blocks, slots, block_layout, rank, layers=(begin, end)).synchronize()
                begin = end
    for block, slot in zip(blocks, slots, strict=True):
        view = pool.slot_view(int(slot), block_layout.slot_stride)
        shards = [expected_shard(kv, int(block)) for kv in kvs]
        assert np.array_equal(view[: block_layout.block_bytes], np.concatenate(shards))
    for rank in range(tp):
        back = gpu_planes(layout, torch.zeros_like(kvs[rank]))
        with GpuBlockCopier(back, pool) as copier:
            begin = 0
            for end in copier.copied_planes.layer_splits:
                handle = copier.load(targets, slots, block_layout, rank, layers=(begin, end))
                handle.wait_layer(end - 1)  # the current stream: after this range
                begin = end
            torch.cuda.current_stream().synchronize()
        for target, block in zip(targets, blocks, strict=True):
            got = np.concatenate([raw(p[int(target)]) for p in back.planes])
            assert np.array_equal(got, expected_shard(kvs[rank], int(block)))
