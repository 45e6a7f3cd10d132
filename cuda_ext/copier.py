"""Block copies between one rank's KV planes and CPU slots, wherever the planes live.

    planes = kv_planes(kv, "vllm_flash")           # cuda_ext.layouts
    layout = planes.block_layout(tp_size)
    with open_copier(planes, pool) as copier:      # GpuBlockCopier for CUDA planes, else CPU
        copier.save(block_ids, slots, layout, rank).synchronize()
        handle = copier.load(block_ids, slots, layout, rank)
        handle.wait_layer(0)    # work queued next on the current stream sees layer 0

Every copier takes the same arguments and rejects bad ones the same way
(`check_request`) before a byte moves. A CPU copy (and a staged one, the
fallback for CUDA planes without libkvcopy.so) is done when it returns; its
handle only keeps the interface the same. Every copier copies the planes'
`coalesced()` form (a cross-layer block's layers as one chunk): the same
slot bytes in fewer, larger copies.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch

from cuda_ext.layouts import KVPlanes
from shm import copy as shm_copy
from shm.layout import BlockLayout
from shm.pool import ShmPool

if TYPE_CHECKING:
    from cuda_ext.gpu import GpuBlockCopier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyRequest:
    """A checked save or load: every id in range, no two copies writing the same bytes."""

    blocks: np.ndarray
    """int64 engine block ids."""
    segments: np.ndarray
    """int64 pool segment of each slot."""
    offsets: np.ndarray
    """int64 byte offset, in its segment, of this rank's shard of each slot."""


def check_request(
    planes: KVPlanes,
    pool: ShmPool,
    block_ids: Any,
    slots: Any,
    layout: BlockLayout,
    rank: int,
    *,
    save: bool,
) -> CopyRequest:
    """Check a copy of engine blocks block_ids[i] <-> slots[i]; TypeError or
    ValueError says what is wrong. Slots must be distinct for a save (each
    writes one), block ids for a load."""
    check_layout(planes, layout, rank)
    blocks, slots = _ids("block_ids", block_ids), _ids("slots", slots)
    if blocks.size != slots.size:
        raise ValueError(f"{blocks.size} block ids but {slots.size} slots")
    shm_copy.check_block_ids(blocks, planes.num_blocks)
    unique, what = (slots, "slots") if save else (blocks, "block_ids")
    if shm_copy.has_repeats(unique):
        raise ValueError(f"{what} repeat: two copies would write the same bytes")
    if not isinstance(pool, ShmPool):
        raise TypeError(f"pool must be a ShmPool, got {type(pool).__name__}")
    segments, offsets = pool.slot_locations(slots, layout.slot_stride)  # range-checks slots
    return CopyRequest(blocks, segments, offsets + rank * layout.shard_bytes)


def check_layout(planes: KVPlanes, layout: BlockLayout, rank: int) -> None:
    """The part of check_request about the layout and the rank."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if (layout.num_layers, layout.layer_block_bytes) != (len(planes.planes), planes.chunk_bytes):
        raise ValueError(
            f"the layout has {layout.num_layers} planes of {layout.layer_block_bytes} bytes, "
            f"the KV {len(planes.planes)} of {planes.chunk_bytes}: use planes.block_layout()"
        )
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < layout.tp_size:
        raise ValueError(f"rank {rank} out of range 0..{layout.tp_size - 1}")


def _ids(what: str, values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {array.dtype}")
    return array.astype(np.int64) if array.size else np.zeros(0, np.int64)


def coalesced_layout(copy_planes: KVPlanes, layout: BlockLayout) -> BlockLayout:
    """`layout` (checked against the planes) for their coalesced form: the
    same shard, in fewer, larger chunks."""
    return BlockLayout(len(copy_planes.planes), copy_planes.chunk_bytes, layout.tp_size)


class DoneHandle:
    """A copy that finished before it was returned."""

    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        if not 0 <= layer < self._num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self._num_layers - 1}")

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


class CpuBlockCopier:
    """CPU planes <-> slots with shm.copy (its C extension, else the torch
    loop): the path for CPU-only engines and CI, for every layout."""

    def __init__(self, planes: KVPlanes, pool: ShmPool, *, impl: str | None = None) -> None:
        if planes.device.type != "cpu":
            raise ValueError(f"CpuBlockCopier needs CPU planes, not {planes.device}")
        self.planes, self.pool, self.impl = planes, pool, impl
        self.copied_planes = planes.coalesced()
        """What the copies read and write: `planes` coalesced (the same bytes)."""
        self._checked: shm_copy.Planes | None = None
        """The coalesced planes checked once for the C copy (None: the
        extension is not built, or `impl` asks for torch's loop)."""
        if (impl or shm_copy.IMPL) == "c":
            chunks = self.copied_planes
            layout = BlockLayout(len(chunks.planes), chunks.chunk_bytes)
            self._checked = shm_copy.Planes(chunks.planes, layout)

    def save(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        layers: tuple[int, int] | None = None,
    ) -> DoneHandle:
        """Copy engine block block_ids[i] into this rank's shard of slot
        slots[i]; `layers` (begin, end): those model layers only."""
        return self._copy(block_ids, slots, layout, rank, layers, save=True)

    def load(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        layers: tuple[int, int] | None = None,
    ) -> DoneHandle:
        """Copy this rank's shard of slot slots[i] into engine block
        block_ids[i]; `layers` (begin, end): those model layers only."""
        return self._copy(block_ids, slots, layout, rank, layers, save=False)

    def _copy(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        layers: tuple[int, int] | None,
        *,
        save: bool,
    ) -> DoneHandle:
        request = check_request(self.planes, self.pool, block_ids, slots, layout, rank, save=save)
        part = _planes_of(self.copied_planes, layers)
        if self._checked is not None:  # the planes were checked once: only the ids now
            shm_copy.copy_located(
                self._checked,
                request.blocks,
                self.pool,
                request.segments,
                request.offsets,
                save,
                layer_range=part,
            )
        else:
            planes, pool = self.copied_planes.planes, self.pool
            layout = coalesced_layout(self.copied_planes, layout)
            copy = shm_copy.save_blocks if save else shm_copy.load_blocks
            copy(
                planes, request.blocks, pool, slots, layout, rank, impl=self.impl, layer_range=part
            )
        return DoneHandle(self.planes.num_layers)

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> CpuBlockCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagedBlockCopier:
    """Planes on any torch device <-> slots through CPU staging tensors, in
    torch: a save gathers the blocks on the device and copies them to the
    host, then into the slots with shm.copy; a load the reverse, the scatter
    queued on the current stream (work queued after it sees the blocks).
    The fallback for CUDA planes where libkvcopy.so cannot run (not built,
    or a driver older than its CUDA runtime): the same bytes, synchronous,
    slower (two copies, pageable host memory)."""

    def __init__(self, planes: KVPlanes, pool: ShmPool, *, impl: str | None = None) -> None:
        self.planes, self.pool, self.impl = planes, pool, impl
        self.copied_planes = planes.coalesced()
        """What the copies read and write: `planes` coalesced (the same bytes)."""

    def save(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        layers: tuple[int, int] | None = None,
    ) -> DoneHandle:
        """Copy engine block block_ids[i] into this rank's shard of slot
        slots[i]; `layers` (begin, end): those model layers only."""
        request = check_request(self.planes, self.pool, block_ids, slots, layout, rank, save=True)
        begin, end = _planes_of(self.copied_planes, layers) or (0, len(self.copied_planes.planes))
        index = torch.from_numpy(request.blocks).to(self.planes.device)
        planes = self.copied_planes.planes
        # Planes outside the range are never read: empty rows keep the slot offsets.
        staged = [
            planes[p].index_select(0, index).cpu()
            if begin <= p < end
            else torch.empty(
                (len(request.blocks), self.copied_planes.chunk_bytes), dtype=torch.uint8
            )
            for p in range(len(planes))
        ]
        rows = np.arange(len(request.blocks))
        layout = coalesced_layout(self.copied_planes, layout)
        shm_copy.save_blocks(
            staged, rows, self.pool, slots, layout, rank, impl=self.impl, layer_range=(begin, end)
        )
        return DoneHandle(self.planes.num_layers)

    def load(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        layers: tuple[int, int] | None = None,
    ) -> DoneHandle:
        """Copy this rank's shard of slot slots[i] into engine block
        block_ids[i]; `layers` (begin, end): those model layers only."""
        request = check_request(self.planes, self.pool, block_ids, slots, layout, rank, save=False)
        begin, end = _planes_of(self.copied_planes, layers) or (0, len(self.copied_planes.planes))
        n, chunk = len(request.blocks), self.copied_planes.chunk_bytes
        staged = [torch.empty((n, chunk), dtype=torch.uint8) for _ in self.copied_planes.planes]
        layout = coalesced_layout(self.copied_planes, layout)
        shm_copy.load_blocks(
            staged, np.arange(n), self.pool, slots, layout, rank, impl=self.impl,
            layer_range=(begin, end),
        )  # fmt: skip
        index = torch.from_numpy(request.blocks).to(self.planes.device)
        for plane, rows in zip(
            self.copied_planes.planes[begin:end], staged[begin:end], strict=True
        ):
            plane.index_copy_(0, index, rows.to(plane.device))
        return DoneHandle(self.planes.num_layers)

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> StagedBlockCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


BlockCopier: TypeAlias = "CpuBlockCopier | GpuBlockCopier | StagedBlockCopier"
"""Any of them: they take the same arguments and return handles alike."""


def _planes_of(planes: KVPlanes, layers: tuple[int, int] | None) -> tuple[int, int] | None:
    """The copied planes of model layers `layers` (None: all); checked before a byte moves."""
    return None if layers is None else planes.plane_range(layers)


def open_copier(planes: KVPlanes, pool: ShmPool, **gpu_options: Any) -> BlockCopier:
    """A CpuBlockCopier for CPU planes; for CUDA planes a GpuBlockCopier, or
    where libkvcopy.so cannot run here (cuda_ext.GpuUnavailable, logged once)
    a StagedBlockCopier."""
    if planes.device.type == "cuda":
        from cuda_ext._lib import GpuUnavailable
        from cuda_ext.gpu import GpuBlockCopier

        try:
            return GpuBlockCopier(planes, pool, **gpu_options)
        except GpuUnavailable as err:
            _warn_once(f"GPU block copies take torch's staged path (slower): {err}")
            return StagedBlockCopier(planes, pool)
    return CpuBlockCopier(planes, pool)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("kvsidecar: %s", message)
