"""Engine-side block copies between one TP rank's paged KV tensors and shm slots.

`save_blocks` copies engine blocks into slots (the D2H side of a PUT),
`load_blocks` copies slots into engine blocks (the H2D side of a GET). Both
check every argument before touching a byte: bad input raises TypeError or
ValueError and copies nothing.

Two implementations give identical bytes:
- "c": address arrays built with numpy, copied by the `shm._blockcopy`
  extension with the GIL released (each next source range prefetched;
  streaming stores for saves and large loads, two threads for large
  batches: `copy_settings`);
- "torch": a Python loop of slice copies over torch views of the segments,
  used when the extension is not built.

Strided tensors: a tensor's blocks need only be contiguous each, not one
after the other (rows `stride(0)` elements apart: a padded page, one layer
of a cross-layer block, one head of a head-outer layer, as cuda_ext.layouts
makes them). Each (block, layer) range is then copied from its own address,
with no staging copy.

Alignment: slots are page-aligned and a rank's layer starts at a multiple of
layer_block_bytes inside one. torch's CPU allocator returns 64-byte-aligned
storage (large tensors start 64 bytes past a page boundary), so source and
destination share their alignment mod 64 when layer_block_bytes is a
multiple of 64. Either way the C copy aligns its stores to the destination
and loads unaligned, and measured no loss at a 16-byte relative offset, nor
from torch's 64-byte offset against page-aligned sources (a 2,048 x 32 x 4
KiB gather, docs/measurements.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from shm.layout import BlockLayout
from shm.pool import ShmPool, id_bounds

if TYPE_CHECKING:
    import torch

try:
    from shm import _blockcopy
except ImportError:  # the extension is optional; the torch loop gives the same bytes
    _blockcopy = None  # type: ignore[assignment]

IMPLS: tuple[str, ...] = ("c", "torch") if _blockcopy is not None else ("torch",)
IMPL = IMPLS[0]
"""The implementation save_blocks / load_blocks use unless told otherwise."""

# Below these batch sizes a load mostly stays in cache (where the engine reads
# it next) and a second thread costs more to start (~50 us) than it saves.
STREAM_MIN_BYTES = 4 << 20
THREAD_MIN_BYTES = 8 << 20
MAX_THREADS = min(2, len(os.sched_getaffinity(0)))
# A save reads each layer's pieces of this many bytes of blocks in a row, the
# blocks in bands of that size, each band layer by layer: 2,048 blocks of 32 x
# 4 KiB ran at 0.93-0.97x a contiguous copy of whole blocks in bands of 256,
# 0.86-0.92x layer by layer across all blocks (paired rounds, page-aligned and
# shuffled slots; at 64 KiB pieces both ~0.93-0.99x). With two threads, each
# takes about half the bands.
BAND_BYTES = 1 << 20


def save_blocks(
    kv_layers: Sequence[torch.Tensor],
    block_ids: np.ndarray,
    pool: ShmPool,
    slots: np.ndarray,
    layout: BlockLayout,
    rank: int,
    *,
    impl: str | None = None,
    threads: int | None = None,
    layer_range: tuple[int, int] | None = None,
) -> None:
    """Copy engine block block_ids[i] of every layer l into slot slots[i] at
    layout.offset(rank, l). Slots must be distinct.

    `impl` picks "c" or "torch" (default IMPL); `threads` caps the C copy's
    threads (default: MAX_THREADS for batches of THREAD_MIN_BYTES or more);
    `layer_range` (begin, end) copies layers begin..end-1 only (a layer-wise
    transfer: the same bytes, a part at a time)."""
    _transfer(
        kv_layers, block_ids, pool, slots, layout, rank, impl, threads, layer_range, save=True
    )


def load_blocks(
    kv_layers: Sequence[torch.Tensor],
    block_ids: np.ndarray,
    pool: ShmPool,
    slots: np.ndarray,
    layout: BlockLayout,
    rank: int,
    *,
    impl: str | None = None,
    threads: int | None = None,
    layer_range: tuple[int, int] | None = None,
) -> None:
    """Copy slot slots[i] at layout.offset(rank, l) into engine block
    block_ids[i] of every layer l. Block ids must be distinct. `impl`,
    `threads` and `layer_range` as for save_blocks."""
    _transfer(
        kv_layers, block_ids, pool, slots, layout, rank, impl, threads, layer_range, save=False
    )


def _transfer(
    kv_layers: Sequence[torch.Tensor],
    block_ids: np.ndarray,
    pool: ShmPool,
    slots: np.ndarray,
    layout: BlockLayout,
    rank: int,
    impl: str | None,
    threads: int | None,
    layer_range: tuple[int, int] | None,
    *,
    save: bool,
) -> None:
    impl = IMPL if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 16
    ):
        raise ValueError(f"threads must be an int in 1..16, got {threads!r}")
    planes = Planes(kv_layers, layout)
    layers = planes.layers
    first, end = _check_range(layer_range, len(layers))
    blocks = _index_array("block_ids", block_ids)
    slots = _index_array("slots", slots)
    if blocks.size != slots.size:
        raise ValueError(f"{blocks.size} block ids but {slots.size} slots")
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < layout.tp_size:
        raise ValueError(f"rank {rank} out of range 0..{layout.tp_size - 1}")
    check_block_ids(blocks, layers[0].shape[0])
    unique, what = (slots, "slots") if save else (blocks, "block_ids")
    if has_repeats(unique):
        raise ValueError(f"{what} repeat: two copies would write the same bytes")
    if not isinstance(pool, ShmPool):
        raise TypeError(f"pool must be a ShmPool, got {type(pool).__name__}")
    segments, offsets = pool.slot_locations(slots, layout.slot_stride)  # range-checks slots
    if blocks.size == 0:
        return
    offsets += rank * layout.shard_bytes
    if impl == "c":
        copy_located(planes, blocks, pool, segments, offsets, save, threads, (first, end))
    else:
        pins = [pool.segment_view(i) for i in range(len(pool.segment_sizes))]
        offsets += first * layout.layer_block_bytes
        _copy_torch(layers[first:end], blocks, pins, segments, offsets, layout, save)


class Planes:
    """One rank's KV tensors, checked once, for many copies with the C
    extension (`copy_located`): each layer's start address and block stride.
    Holds the tensors, so the addresses stay theirs while it lives."""

    def __init__(self, kv_layers: Sequence[torch.Tensor], layout: BlockLayout) -> None:
        """TypeError / ValueError as save_blocks says, for tensors that do
        not fit `layout` (its rank and TP size do not matter here)."""
        self.layers = _check_layers(kv_layers, layout)
        self.layer_bytes = layout.layer_block_bytes
        self.num_blocks = int(self.layers[0].shape[0])
        self.starts = np.array([t.data_ptr() for t in self.layers], dtype=np.uint64)
        self.strides = np.array([_block_stride(t) for t in self.layers], dtype=np.uint64)
        self.per_layer = np.arange(len(self.layers), dtype=np.uint64) * np.uint64(self.layer_bytes)


def copy_located(
    planes: Planes,
    blocks: np.ndarray,
    pool: ShmPool,
    segments: np.ndarray,
    offsets: np.ndarray,
    save: bool,
    threads: int | None = None,
    layer_range: tuple[int, int] | None = None,
) -> None:
    """The C copy of engine blocks `blocks` <-> the slot bytes at (segment,
    byte offset of the rank's shard) of the pool, ids already checked (in
    range, the written side distinct: what save_blocks checks); layers
    layer_range[0]..[1]-1 only (checked here). Raises RuntimeError without
    the C extension."""
    if _blockcopy is None:
        raise RuntimeError("shm._blockcopy is not built")
    if blocks.size == 0:
        return
    # Views pin the mappings until the copy is done: a close() meanwhile defers the unmap.
    used = np.unique(segments) if segments.size > 1 else segments
    pins = [pool.segment_view(int(i)) for i in used]
    bases = np.zeros(len(pool.segment_sizes), dtype=np.uint64)
    bases[used] = [pin.ctypes.data for pin in pins]
    # The C copy builds the (block, layer) address pairs in the order it
    # runs them. A save reads each layer's pieces in address order, in bands
    # of blocks (BAND_BYTES says why); block by block it ran at 0.75x the
    # contiguous floor (2,048 blocks of 32 x 4 KiB). A load reads each slot
    # in order and writes the scattered pieces: 0.98-1.01x.
    first, end = _check_range(layer_range, len(planes.layers))
    ids = blocks.astype(np.uint64)
    slot_starts = bases[segments]
    slot_starts += offsets.astype(np.uint64)
    if save and ids.size > 1 and not bool((ids[1:] >= ids[:-1]).all()):
        # Engine block ids come in any order (vLLM's free list): read them
        # in increasing order, slots following. 512 blocks of 32 x 64 KiB,
        # ids and slots random permutations: 0.91-0.98x the floor sorted,
        # 0.86-0.94x not (alternated, one process); ~40 us for 2,048 ids.
        order = np.argsort(ids, kind="stable")
        ids, slot_starts = ids[order], slot_starts[order]
    size = planes.layer_bytes
    threads, stream = copy_settings(
        ids.size * (end - first) * size, threads or MAX_THREADS, save=save
    )
    _blockcopy.copy_blocks(
        planes.starts[first:end],
        planes.strides[first:end],
        planes.per_layer[first:end],
        ids,
        slot_starts,
        size,
        save,
        max(1, BAND_BYTES // size),
        threads,
        stream,
    )
    del pins


def _check_range(layer_range: tuple[int, int] | None, num_layers: int) -> tuple[int, int]:
    if layer_range is None:
        return 0, num_layers
    if (
        not isinstance(layer_range, tuple)
        or len(layer_range) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in layer_range)
        or not 0 <= layer_range[0] < layer_range[1] <= num_layers
    ):
        raise ValueError(
            f"layer_range must be (begin, end) in 0..{num_layers}, got {layer_range!r}"
        )
    return layer_range


def check_block_ids(blocks: np.ndarray, num_blocks: int) -> None:
    """ValueError unless every engine block id is in 0..num_blocks-1."""
    if blocks.size:
        low, high = id_bounds(blocks)
        if low < 0 or high >= num_blocks:
            raise ValueError(f"block id out of range 0..{num_blocks - 1}")


def has_repeats(ids: np.ndarray) -> bool:
    """Whether a 1-D id array holds some id twice: ~3 us for 2,048 ids in
    increasing order (the usual case), else a sort (~40 us; np.unique is
    several times slower)."""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return False
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def copy_settings(total_bytes: int, max_threads: int, *, save: bool) -> tuple[int, bool]:
    """(threads, streaming stores) the C copy uses for a batch of this many
    bytes; `bench shm` and `bench control` give their floors and peers the same.

    A save streams at any size: it writes slots nothing reads again soon (a
    later load, the lower tiers' writers), and the slot it gets is cold (the
    free stack's top was freed by eviction, or granted dozens of saves ago),
    so a cached store first reads every destination line. One 2 MiB block
    saved into a cold slot: 337-340 us cached, 218 us streamed; into the
    slot just written: 234 against 216. A 128 KiB one: 35-46 against 32
    cold, 28 against 32 hot (docs/measurements.md, "Streaming saves"). A
    load streams only past STREAM_MIN_BYTES: below, the engine's blocks it
    writes are read next from the cache (128 KiB: 28-39 us cached against
    32-42 streamed)."""
    threads = max_threads if total_bytes >= THREAD_MIN_BYTES else 1
    return threads, save or total_bytes >= STREAM_MIN_BYTES


def _copy_torch(
    layers: tuple[torch.Tensor, ...],
    blocks: np.ndarray,
    pins: list[np.ndarray],
    segments: np.ndarray,
    offsets: np.ndarray,
    layout: BlockLayout,
    save: bool,
) -> None:
    import torch

    size = layout.layer_block_bytes
    engine = [_rows(t.detach()).view(torch.uint8) for t in layers]
    shm = [torch.from_numpy(pin) for pin in pins]
    for block, segment, offset in zip(
        blocks.tolist(), segments.tolist(), offsets.tolist(), strict=True
    ):
        region = shm[segment]
        for layer, tensor in enumerate(engine):
            start = offset + layer * size
            if save:
                region[start : start + size].copy_(tensor[block])
            else:
                tensor[block].copy_(region[start : start + size])


def _check_layers(
    kv_layers: Sequence[torch.Tensor], layout: BlockLayout
) -> tuple[torch.Tensor, ...]:
    import torch

    if isinstance(kv_layers, torch.Tensor) or not isinstance(kv_layers, Sequence):
        raise TypeError("kv_layers must be a sequence of per-layer tensors")
    layers = tuple(kv_layers)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if len(layers) != layout.num_layers:
        raise ValueError(f"{len(layers)} KV tensors but the layout has {layout.num_layers} layers")
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kv_layers[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(
                f"kv_layers[{i}] must be a dense CPU tensor, not {t.device} {t.layout}"
            )
        if t.dim() < 1 or t.shape[0] == 0:
            raise ValueError(f"kv_layers[{i}] must be shaped [num_blocks, ...], got {t.shape}")
        if not _blocks_contiguous(t) or t.is_conj() or t.is_neg():
            raise ValueError(
                f"kv_layers[{i}] must hold each block contiguous, blocks at least a block "
                f"apart (and not be a conj/neg view): shape {tuple(t.shape)}, strides {t.stride()}"
            )
        if t.dtype != layers[0].dtype or t.shape != layers[0].shape:
            raise ValueError(
                f"kv_layers[{i}] is {t.dtype} {tuple(t.shape)}, "
                f"kv_layers[0] is {layers[0].dtype} {tuple(layers[0].shape)}"
            )
    block_bytes = math.prod(layers[0].shape[1:]) * layers[0].element_size()
    if block_bytes != layout.layer_block_bytes:
        raise ValueError(
            f"one block of one layer is {block_bytes} bytes, "
            f"the layout says {layout.layer_block_bytes}"
        )
    return layers


def _blocks_contiguous(t: torch.Tensor) -> bool:
    """Each block t[b] contiguous and blocks not overlapping: a contiguous
    tensor, or one whose rows are padded or interleaved with other memory."""
    if t.is_contiguous():
        return True
    block = t[0]
    return block.is_contiguous() and (t.shape[0] == 1 or t.stride(0) >= max(block.numel(), 1))


def _block_stride(t: torch.Tensor) -> int:
    """Bytes from one block of `t` to the next."""
    if t.shape[0] == 1:
        return math.prod(t.shape[1:]) * t.element_size()
    return int(t.stride(0)) * t.element_size()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as `[num_blocks, block elements]` over the same memory."""
    row = math.prod(t.shape[1:])
    stride = int(t.stride(0)) if t.shape[0] > 1 else row
    return t.as_strided((t.shape[0], row), (stride, 1), t.storage_offset())


def _index_array(what: str, values: np.ndarray) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {array.dtype}")
    return array.astype(np.int64) if array.size else np.zeros(0, np.int64)
