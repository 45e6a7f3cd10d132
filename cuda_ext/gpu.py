"""`GpuBlockCopier`: one rank's CUDA KV planes <-> CPU slots, with libkvcopy.so.

    copier = GpuBlockCopier(planes, pool)   # pins and maps the pool once: register_seconds
    copier.save(block_ids, slots, layout, rank)           # D2H: one kernel launch
    handle = copier.load(block_ids, slots, layout, rank)  # H2D: a launch per group of layers
    handle.wait_layer(0)     # the current stream waits for layer 0 only
    handle.synchronize()     # the host waits for everything

Streams: every op runs on the copier's own stream (`copier.stream`), after
the work already queued on the caller's current stream, so a save reads what
the engine wrote and a load does not overwrite blocks still being read. Until
`handle.query()` is True the copy is in flight: a saved block's GPU memory
must not be rewritten, a loaded block must not be read without `wait_layer`
or `wait`, and the sidecar must not be told the op completed (it could evict
or overwrite the slots).

Paths (`path=`), each one launch or one batch per group of planes:
- "sm": the copy_chunks kernel moves 16-byte vectors between GPU memory and
  the mapped pinned shm; needs chunk_bytes, block strides and plane
  addresses multiples of 16.
- "dma": the copy engines: one cudaMemcpyBatchAsync (CUDA 13 runtime and a
  driver that has it), else a loop of cudaMemcpyAsync, one copy per chunk.
- "auto" (default): "dma" for chunks of dma_min_chunk_bytes or more, or when
  "sm" cannot run; "sm" otherwise. `kvsidecar bench gpu` measures both.

Planes may be strided (a padded page, a layer of a cross-layer block, a head
of a head-outer layer: cuda_ext.layouts): both paths read and write each
block at its own address, with no staging copy. The copier copies the
planes' `coalesced()` form, so a cross-layer block is one chunk. Planes must
stay allocated at the same addresses for the copier's life, and the pool
stays mapped and pinned until `close()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any

import numpy as np
import torch

from cuda_ext import _lib
from cuda_ext.copier import CopyRequest, check_layout, check_request
from cuda_ext.gpu_handle import (
    REGISTRATIONS,
    GpuCopyHandle,
    current_stream,
    int64_ids,
    layer_groups,
)
from cuda_ext.layouts import KVPlanes
from shm.layout import BlockLayout
from shm.pool import ShmPool

PATHS = ("auto", "sm", "dma")
# Measured on an H100 (docs/gpu.md): alone, the kernel is faster for chunks
# of 4 to 192 KiB, the copy engines for 2 MiB ones (a cross-layer block).
DMA_MIN_CHUNK_BYTES = 1 << 20
# The sm path's CTAs per launch (256 threads, 16 KiB in flight each), fewer
# than the SMs on purpose: PCIe, not the SMs, limits the copy, and a CTA holds
# its SM until the copy ends, slowing the engine's kernels there. Measured on
# an H100 (docs/gpu.md), 2 MiB blocks: saves reach 0.93x the cudaMemcpy floor
# with 8 CTAs and slow a concurrent matmul 1.12x (5x with one CTA per SM);
# loads need 16 for 0.93x and slow it 1.17x (1.6x with one per SM).
SAVE_CTAS = 8
LOAD_CTAS = 16
# A load launches once per group of model layers holding at least this many
# bytes of the op, so that wait_layer(l) can let an engine start layer l
# while later layers load. A launch of a few MiB loses a few percent to its
# start and its tail of idle CTAs (1,024 small-head blocks: 0.86x the floor
# with one launch per 8 MiB layer against 0.89x with one launch in all, on
# an H100); 16 MiB takes ~0.3 ms there, so an engine waits at most that long
# past its layer's own bytes.
LOAD_GROUP_BYTES = 16 << 20


# An sm op's index (block ids, then slot device addresses) goes through
# pinned host buffers and one device buffer that libkvcopy keeps for the
# copier's life (kv_ops_create), starting at this many int64s (2,048 blocks)
# and growing as ops need: a fresh pinned and device tensor per op cost ~0.1
# ms of host time before the kernel could start (measured on an H100 host).
INDEX_MIN_ENTRIES = 4096


class GpuBlockCopier:
    """Copies between CUDA planes and the slots of one ShmPool (see the module doc)."""

    def __init__(
        self,
        planes: KVPlanes,
        pool: ShmPool,
        *,
        stream: torch.cuda.Stream | None = None,
        path: str = "auto",
        dma_min_chunk_bytes: int = DMA_MIN_CHUNK_BYTES,
        max_ctas: int | None = None,
        load_group_bytes: int = LOAD_GROUP_BYTES,
    ) -> None:
        """Raises GpuUnavailable if libkvcopy.so is missing or cannot run
        here, ValueError for CPU planes or a bad option."""
        if not isinstance(planes, KVPlanes) or planes.device.type != "cuda":
            raise ValueError("GpuBlockCopier needs KVPlanes of CUDA tensors")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if not isinstance(pool, ShmPool):
            raise TypeError(f"pool must be a ShmPool, got {type(pool).__name__}")
        _lib.probe()
        self.planes, self.pool, self.path = planes, pool, path
        self.dma_min_chunk_bytes = int(dma_min_chunk_bytes)
        if isinstance(load_group_bytes, bool) or not isinstance(load_group_bytes, int):
            raise TypeError(f"load_group_bytes must be an int, got {load_group_bytes!r}")
        self.load_group_bytes = max(0, load_group_bytes)
        """A load's launches each cover whole layers holding at least this many
        bytes (0: one launch per layer), the last launch what is left."""
        self.device = planes.device
        self._index = self.device.index if self.device.index is not None else 0
        self.stream = stream if stream is not None else torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._stream_ptr = int(self.stream.cuda_stream)
        self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # the dma path's: where the caller's stream stood
        # One op's upload and launches at a time: another thread's upload
        # between them would overwrite the index they read.
        self._enqueue = threading.Lock()
        self._lib = _lib.load()
        self.copied_planes = planes.coalesced()
        """What the copies read and write: `planes` coalesced (a cross-layer
        block's layers as one chunk; the same bytes)."""
        self._plane_addrs = np.array(
            [p.data_ptr() for p in self.copied_planes.planes], dtype=np.uint64
        )
        self._plane_strides = np.array(self.copied_planes.block_strides, dtype=np.uint64)
        self.sm_capable = (
            self.copied_planes.chunk_bytes % 16 == 0
            and not (self._plane_addrs % 16).any()
            and not (self._plane_strides % 16).any()
        )
        if max_ctas is not None and (isinstance(max_ctas, bool) or max_ctas < 1):
            raise ValueError(f"max_ctas must be a positive int or None, got {max_ctas!r}")
        sms = _lib.sm_count(self._index)
        self._ctas = {  # by direction: save (D2H) or not
            save: min(sms, int(max_ctas) if max_ctas else default)
            for save, default in ((True, SAVE_CTAS), (False, LOAD_CTAS))
        }
        self._try_batch = bool(self._lib.kv_has_batch_memcpy())
        self.dma_kind: str | None = None
        """"batch" or "loop": what the last DMA op used."""
        self.batch_error: str | None = None
        """Why cudaMemcpyBatchAsync was given up, if it was."""
        self.closed = False
        self._ops = ctypes.c_void_p(0)  # libkvcopy's sm-path state (kv_ops_create)
        self._pins = [pool.segment_view(i) for i in range(len(pool.segment_sizes))]
        self._registered: list[tuple[int, int]] = []
        start = time.perf_counter()
        try:
            devs = []
            with torch.cuda.device(self.device):
                for pin in self._pins:
                    devs.append(REGISTRATIONS.acquire(self._index, pin.ctypes.data, pin.nbytes))
                    self._registered.append((pin.ctypes.data, pin.nbytes))
            self.register_seconds = time.perf_counter() - start
            """How long pinning and mapping the pool took (0 if done earlier in this process)."""
            self._host_bases = np.array([pin.ctypes.data for pin in self._pins], dtype=np.uint64)
            self._dev_bases = np.array(devs, dtype=np.uint64)
            if self.sm_capable:
                code = self._lib.kv_ops_create(
                    self._index,
                    self._stream_ptr,
                    self._plane_addrs.ctypes.data,
                    self._plane_strides.ctypes.data,
                    self._plane_addrs.size,
                    self.copied_planes.chunk_bytes,
                    planes.num_blocks,
                    self._dev_bases.ctypes.data,
                    self._dev_bases.size,
                    self._ctas[True],
                    self._ctas[False],
                    INDEX_MIN_ENTRIES,
                    ctypes.byref(self._ops),
                )
                _lib.check(code, "the sm path's set-up (kv_ops_create)")
        except BaseException:
            self.close()
            raise
        self._slot_maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._group_cache: dict[tuple[bool, int, int], tuple[np.ndarray, list[int]]] = {}

    def save(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        path: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> GpuCopyHandle:
        """Queue engine block block_ids[i] -> this rank's shard of slot
        slots[i]; `layers` (begin, end): those model layers only (the dma
        path: the sm path's launches start at plane 0)."""
        if layers is not None:
            return self._run_part(block_ids, slots, layout, rank, layers, save=True)
        return self._run(block_ids, slots, layout, rank, save=True, path=path, layer_events=False)

    def load(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        path: str | None = None,
        layer_events: bool = True,
        layers: tuple[int, int] | None = None,
    ) -> GpuCopyHandle:
        """Queue this rank's shard of slot slots[i] -> engine block block_ids[i].
        With layer_events (a launch per group of layers of at least
        load_group_bytes) `wait_layer(l)` waits for the group holding layer l
        only; without, one launch and every layer lands at the end.
        `layers` (begin, end): those model layers only, in one launch (the
        dma path)."""
        if layers is not None:
            return self._run_part(block_ids, slots, layout, rank, layers, save=False)
        return self._run(
            block_ids, slots, layout, rank, save=False, path=path, layer_events=layer_events
        )

    def choose_path(self, path: str | None = None) -> str:
        """The path ("sm" or "dma") an op asking for `path` takes."""
        path = self.path if path is None else path
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if path == "auto":
            large = self.copied_planes.chunk_bytes >= self.dma_min_chunk_bytes
            return "dma" if large or not self.sm_capable else "sm"
        if path == "sm" and not self.sm_capable:
            chunk = self.copied_planes.chunk_bytes
            raise ValueError(
                f"the sm path copies 16-byte vectors: chunk_bytes ({chunk}), block strides "
                "and plane addresses must be multiples of 16; use path='dma'"
            )
        return path

    def close(self) -> None:
        """Wait for queued copies, then unpin the pool. Idempotent. An op
        another thread is queueing finishes first; a later one raises."""
        with self._enqueue:
            if self.closed:
                return
            self.closed = True
        try:
            self.stream.synchronize()
        finally:  # freed and unpinned even after a CUDA error; the first error is raised
            errors = []
            ops, self._ops = self._ops, ctypes.c_void_p(0)
            if ops.value:
                try:
                    _lib.check(self._lib.kv_ops_destroy(ops), "kv_ops_destroy")
                except _lib.CudaError as err:
                    errors.append(err)
            registered, self._registered, self._pins = self._registered, [], []
            with torch.cuda.device(self.device):
                for address, nbytes in registered:
                    try:
                        REGISTRATIONS.release(address, nbytes)
                    except _lib.CudaError as err:
                        errors.append(err)
            if errors:
                raise errors[0]

    def __del__(self) -> None:
        # A copier dropped unclosed still frees libkvcopy's buffers and its
        # pins; at interpreter exit CUDA may be gone already, and there is
        # no one left to tell.
        if not getattr(self, "closed", True):
            with contextlib.suppress(Exception):
                self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the copier is closed")

    def __enter__(self) -> GpuBlockCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        save: bool,
        path: str | None,
        layer_events: bool,
    ) -> GpuCopyHandle:
        """An sm op is one libkvcopy call that checks the ids, uploads the
        index and queues the launches (kv_ops_run); whatever it refuses goes
        through check_request, which says what is wrong. Bad arguments raise
        before anything is queued."""
        self._check_open()
        if self.choose_path(path) == "dma":
            request = check_request(
                self.planes, self.pool, block_ids, slots, layout, rank, save=save
            )
            return self._run_dma(request, save, layer_events)
        check_layout(self.planes, layout, rank)
        blocks, slot_ids = int64_ids(block_ids), int64_ids(slots)
        if blocks is None or slot_ids is None or blocks.size != slot_ids.size:
            check_request(self.planes, self.pool, block_ids, slots, layout, rank, save=save)
            blocks = slot_ids = np.zeros(0, np.int64)  # it passed: no ids at all
        n = int(blocks.size)
        seg_slots, seen = self._slot_map(layout.slot_stride)
        group_ends, event_of_layer = self._groups(layer_events, n)
        events = np.zeros(group_ends.size, np.uint64)
        refused = ctypes.c_int(0)
        with self._enqueue:
            self._check_open()
            code = self._lib.kv_ops_run(
                self._ops,
                blocks.ctypes.data,
                slot_ids.ctypes.data,
                n,
                seg_slots.ctypes.data,
                layout.slot_stride,
                rank * layout.shard_bytes,
                seen.ctypes.data,
                int(save),
                current_stream(self._index),
                group_ends.ctypes.data,
                group_ends.size,
                events.ctypes.data,
                ctypes.byref(refused),
            )
        _lib.check(code, "copy_chunks op (kv_ops_run)")
        if refused.value:
            check_request(self.planes, self.pool, blocks, slot_ids, layout, rank, save=save)
            raise RuntimeError(
                f"libkvcopy refused ids that check_request accepts (code {refused.value})"
            )
        return GpuCopyHandle(self.device, events, event_of_layer)

    def _run_part(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        layers: tuple[int, int],
        *,
        save: bool,
    ) -> GpuCopyHandle:
        """The copies of model layers `layers` only, on the dma path in one
        launch; every layer's wait is that launch's event."""
        self._check_open()
        request = check_request(self.planes, self.pool, block_ids, slots, layout, rank, save=save)
        begin, end = self.copied_planes.plane_range(layers)
        event_of_layer = [0] * self.copied_planes.num_layers
        return self._run_dma(
            request, save, False, (np.array([end], np.int64), event_of_layer), begin
        )

    def _run_dma(
        self,
        request: CopyRequest,
        save: bool,
        layer_events: bool,
        groups: tuple[np.ndarray, list[int]] | None = None,
        first_plane: int = 0,
    ) -> GpuCopyHandle:
        """`groups` (default `_groups`) from `first_plane` on."""
        n = int(request.blocks.size)
        group_ends, event_of_layer = groups or self._groups(layer_events, n)
        events = np.zeros(group_ends.size, np.uint64)
        caller = torch.cuda.current_stream(self.device)
        with self._enqueue:
            self._check_open()
            self._ready.record(caller)  # the op runs after what the caller queued
            self.stream.wait_event(self._ready)
            try:
                begin = first_plane
                for g, end in enumerate(group_ends.tolist()):
                    if n:
                        self._launch_dma(request, begin, end, save)
                    event = ctypes.c_void_p(0)
                    code = self._lib.kv_event_record_new(
                        self._index, self._stream_ptr, ctypes.byref(event)
                    )
                    _lib.check(code, "cudaEventRecord")
                    events[g], begin = event.value or 0, end
            except BaseException:
                self._lib.kv_events_destroy(self._index, events.ctypes.data, events.size)
                raise
        return GpuCopyHandle(self.device, events, event_of_layer)

    def _groups(self, layer_events: bool, n: int) -> tuple[np.ndarray, list[int]]:
        """`layer_groups` of this copier's planes, cached."""
        key = (layer_events, n, self.load_group_bytes)
        found = self._group_cache.get(key)
        if found is not None:
            return found
        grouped = layer_groups(self.copied_planes, layer_events, n, self.load_group_bytes)
        if len(self._group_cache) >= 64:
            self._group_cache.clear()
        found = self._group_cache[key] = grouped
        return found

    def _slot_map(self, stride: int) -> tuple[np.ndarray, np.ndarray]:
        """Per slot stride: slots in each pool segment, and a zeroed bitmap
        with a bit per slot or engine block (kv_stage_index's `seen`)."""
        found = self._slot_maps.get(stride)
        if found is None:
            seg_slots = np.array([size // stride for size in self.pool.segment_sizes], np.int64)
            bits = max(int(seg_slots.sum()), self.planes.num_blocks)
            found = self._slot_maps[stride] = (seg_slots, np.zeros(bits // 8 + 1, np.uint8))
        return found

    def _launch_dma(self, request: CopyRequest, begin: int, end: int, save: bool) -> None:
        """One copy per (plane, block) of planes [begin, end), plane-major."""
        chunk = np.uint64(self.copied_planes.chunk_bytes)
        blocks = request.blocks.astype(np.uint64)
        strides = self._plane_strides[begin:end, None]
        gpu = self._plane_addrs[begin:end, None] + blocks[None, :] * strides
        host = self._host_bases[request.segments] + request.offsets.astype(np.uint64)
        host = host[None, :] + np.arange(begin, end, dtype=np.uint64)[:, None] * chunk
        srcs, dsts = (gpu, host) if save else (host, gpu)
        srcs, dsts = np.ascontiguousarray(srcs.ravel()), np.ascontiguousarray(dsts.ravel())
        used, batch_error = ctypes.c_int(0), ctypes.c_int(0)
        code = self._lib.kv_copy_dma(
            self._index,
            dsts.ctypes.data,
            srcs.ctypes.data,
            self.copied_planes.chunk_bytes,
            srcs.size,
            int(self._try_batch),
            self._stream_ptr,
            ctypes.byref(used),
            ctypes.byref(batch_error),
        )
        _lib.check(code, "DMA copy")
        if batch_error.value:
            self._try_batch = False
            self.batch_error = _lib.error_name(batch_error.value)
        self.dma_kind = "batch" if used.value else "loop"
