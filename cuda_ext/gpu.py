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
  the mapped pinned shm; needs chunk_bytes and plane addresses multiples of 16.
- "dma": the copy engines: one cudaMemcpyBatchAsync (CUDA 13 runtime and a
  driver that has it), else a loop of cudaMemcpyAsync, one copy per chunk.
- "auto" (default): "dma" for chunks of dma_min_chunk_bytes or more, or when
  "sm" cannot run; "sm" otherwise. `kvsidecar bench gpu` measures both.

Planes must stay allocated at the same addresses for the copier's life, and
the pool stays mapped and pinned until `close()`.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import numpy as np
import torch

from cuda_ext import _lib
from cuda_ext.copier import CopyRequest, check_layout, check_request
from cuda_ext.layouts import KVPlanes
from shm.layout import BlockLayout
from shm.pool import ShmPool

PATHS = ("auto", "sm", "dma")
# Not yet measured on a GPU (docs/gpu.md): per-copy DMA setup costs a few
# microseconds, so below ~1 MiB per chunk the kernel is expected to win.
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


class _Registrations:
    """cudaHostRegister once per process per segment, however many copiers
    use it; unregistered when the last of them closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (address, bytes) -> [device pointer, copiers using it, whether we registered it]
        self._entries: dict[tuple[int, int], list] = {}

    def acquire(self, device: int, address: int, nbytes: int) -> int:
        with self._lock:
            entry = self._entries.get((address, nbytes))
            if entry is None:
                pointer, ours = _lib.host_register(device, address, nbytes)
                entry = self._entries[(address, nbytes)] = [pointer, 0, ours]
            entry[1] += 1
            return int(entry[0])

    def release(self, address: int, nbytes: int) -> None:
        with self._lock:
            entry = self._entries[(address, nbytes)]
            entry[1] -= 1
            if entry[1] == 0:
                del self._entries[(address, nbytes)]
                if entry[2]:
                    _lib.host_unregister(address)


_REGISTRATIONS = _Registrations()


class _IndexUploads:
    """An sm op's block ids and slot addresses go to the GPU through a few
    pinned host buffers used in turn and one device buffer, all kept for the
    copier's life: a fresh pinned tensor and device tensor per op cost ~0.1 ms
    of host time before the kernel could start (measured on an H100 host).

    The device buffer is only ever written by a copy queued on the copier's
    stream, so that copy runs after every kernel that read the previous
    index. A host buffer may be rewritten once the copy that read it has run:
    each has an event, waited for (almost always long past) before reuse."""

    RING = 8
    MIN_ENTRIES = 4096  # int64s per buffer at first: 2,048 blocks

    def __init__(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        self._device, self._stream = device, stream
        self._host: list[torch.Tensor] = []
        self._host_np: list[np.ndarray] = []
        self._copied: list[torch.cuda.Event] = []
        self._turn = 0
        self._dev = torch.empty(0, dtype=torch.int64, device=device)

    def reserve(self, n: int) -> np.ndarray:
        """The next pinned host buffer's first n int64s to fill, once no
        queued copy reads that buffer any more."""
        if n > self._dev.numel():
            self._grow(n)
        self._turn = (self._turn + 1) % self.RING
        self._copied[self._turn].synchronize()
        return self._host_np[self._turn][:n]

    def send(self, n: int) -> torch.Tensor:
        """Queue the copy of the reserved buffer's first n int64s to the
        device array the kernel reads; call with the stream current."""
        index = self._dev[:n]
        index.copy_(self._host[self._turn][:n], non_blocking=True)
        self._copied[self._turn].record(self._stream)
        return index

    def _grow(self, n: int) -> None:
        for event in self._copied:  # no queued copy still reads the old buffers
            event.synchronize()
        size = max(n, 2 * self._dev.numel(), self.MIN_ENTRIES)
        self._host = [
            torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(self.RING)
        ]
        self._host_np = [host.numpy() for host in self._host]
        self._copied = [torch.cuda.Event() for _ in range(self.RING)]
        # Allocated on the copier's stream: the caching allocator hands the old
        # buffer to nothing else until the kernels queued there have read it.
        self._dev = torch.empty(size, dtype=torch.int64, device=self._device)


class GpuCopyHandle:
    """A copy queued on a copier's stream; one CUDA event per group of planes."""

    def __init__(
        self, device: torch.device, events: list, event_of_layer: list[int], keep: list
    ) -> None:
        self._device = device
        self._events = events
        self._event_of_layer = event_of_layer
        self._keep = keep  # device index arrays and DMA address lists, alive until done

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current stream) wait until model layer
        `layer` has landed; returns at once. Layers land in order."""
        self._stream(stream).wait_event(self._events[self._event(layer)])

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the whole copy."""
        self._stream(stream).wait_event(self._events[-1])

    def synchronize_layer(self, layer: int) -> None:
        """Block the host until layer `layer` has landed."""
        self._events[self._event(layer)].synchronize()

    def synchronize(self) -> None:
        """Block the host until the whole copy is done."""
        self._events[-1].synchronize()
        self._keep = []

    def query(self) -> bool:
        """Whether the whole copy is done."""
        return bool(self._events[-1].query())

    def _event(self, layer: int) -> int:
        if isinstance(layer, bool) or not 0 <= layer < len(self._event_of_layer):
            raise ValueError(f"layer {layer} out of range 0..{len(self._event_of_layer) - 1}")
        return self._event_of_layer[layer]

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._device) if stream is None else stream


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
        self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
        self._ready = torch.cuda.Event()  # reused: where the caller's stream stood
        # One op's upload and launches at a time: another thread's upload
        # between them would overwrite the index they read.
        self._enqueue = threading.Lock()
        with torch.cuda.stream(self.stream):
            self._indexes = _IndexUploads(self.device, self.stream)
        self._lib = _lib.load()
        self._plane_addrs = np.array([p.data_ptr() for p in planes.planes], dtype=np.uint64)
        with torch.cuda.stream(self.stream):
            self._plane_addrs_dev = torch.from_numpy(self._plane_addrs.view(np.int64)).to(
                self.device
            )
        self.stream.synchronize()
        self.sm_capable = planes.chunk_bytes % 16 == 0 and not (self._plane_addrs % 16).any()
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
        self._pins = [pool.segment_view(i) for i in range(len(pool.segment_sizes))]
        self._registered: list[tuple[int, int]] = []
        start = time.perf_counter()
        try:
            devs = []
            with torch.cuda.device(self.device):
                for pin in self._pins:
                    devs.append(_REGISTRATIONS.acquire(self._index, pin.ctypes.data, pin.nbytes))
                    self._registered.append((pin.ctypes.data, pin.nbytes))
        except BaseException:
            self.close()
            raise
        self.register_seconds = time.perf_counter() - start
        """How long pinning and mapping the pool took (0 if done earlier in this process)."""
        self._host_bases = np.array([pin.ctypes.data for pin in self._pins], dtype=np.uint64)
        self._dev_bases = np.array(devs, dtype=np.uint64)
        self._slot_maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def save(
        self, block_ids: Any, slots: Any, layout: BlockLayout, rank: int, *, path: str | None = None
    ) -> GpuCopyHandle:
        """Queue engine block block_ids[i] -> this rank's shard of slot slots[i]."""
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
    ) -> GpuCopyHandle:
        """Queue this rank's shard of slot slots[i] -> engine block block_ids[i].
        With layer_events (a launch per group of layers of at least
        load_group_bytes) `wait_layer(l)` waits for the group holding layer l
        only; without, one launch and every layer lands at the end."""
        return self._run(
            block_ids, slots, layout, rank, save=False, path=path, layer_events=layer_events
        )

    def choose_path(self, path: str | None = None) -> str:
        """The path ("sm" or "dma") an op asking for `path` takes."""
        path = self.path if path is None else path
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if path == "auto":
            large = self.planes.chunk_bytes >= self.dma_min_chunk_bytes
            return "dma" if large or not self.sm_capable else "sm"
        if path == "sm" and not self.sm_capable:
            raise ValueError(
                f"the sm path copies 16-byte vectors: chunk_bytes ({self.planes.chunk_bytes}) "
                "and plane addresses must be multiples of 16; use path='dma'"
            )
        return path

    def close(self) -> None:
        """Wait for queued copies, then unpin the pool. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.stream.synchronize()
        finally:  # unpinned even after a CUDA error, each in turn; the first error is raised
            registered, self._registered, self._pins = self._registered, [], []
            errors = []
            with torch.cuda.device(self.device):
                for address, nbytes in registered:
                    try:
                        _REGISTRATIONS.release(address, nbytes)
                    except _lib.CudaError as err:
                        errors.append(err)
            if errors:
                raise errors[0]

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
        if self.closed:
            raise RuntimeError("the copier is closed")
        path = self.choose_path(path)
        keep: list = []
        caller = torch.cuda.current_stream(self.device)
        # libkvcopy selects the device itself; being current already, it never
        # switches the engine thread's context.
        with self._enqueue, torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # Bad arguments raise here, before anything is queued.
            index, request = None, None
            if path == "sm":
                n = self._stage(block_ids, slots, layout, rank, save)
                index = self._indexes.send(2 * n) if n else None
            else:
                request = check_request(
                    self.planes, self.pool, block_ids, slots, layout, rank, save=save
                )
                n = int(request.blocks.size)
            groups, event_of_layer = self._groups(layer_events, n)
            events = [torch.cuda.Event() for _ in groups]
            self._ready.record(caller)  # the op runs after what the caller queued
            self.stream.wait_event(self._ready)
            for (begin, end), event in zip(groups, events, strict=True):
                if index is not None:
                    self._launch_sm(index, n, begin, end, save)
                elif request is not None and n:
                    keep.append(self._launch_dma(request, begin, end, save))
                event.record(self.stream)
        keep.append(index)
        return GpuCopyHandle(self.device, events, event_of_layer, keep)

    def _groups(self, layer_events: bool, n: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Plane ranges launched one after another, and which range completes
        each layer: whole layers, at least load_group_bytes of n blocks each."""
        ends = self.planes.layer_ends
        if not layer_events:
            return [(0, len(self.planes.planes))], [0] * len(ends)
        distinct = sorted(set(ends))
        plane_bytes = n * self.planes.chunk_bytes
        groups: list[tuple[int, int]] = []
        begin = 0
        for end in distinct:
            if (end - begin) * plane_bytes >= self.load_group_bytes or end == distinct[-1]:
                groups.append((begin, end))
                begin = end
        group_ends = [end for _, end in groups]
        return groups, [next(i for i, g in enumerate(group_ends) if g >= e) for e in ends]

    def _slot_addresses(self, request: CopyRequest, bases: np.ndarray) -> np.ndarray:
        return bases[request.segments] + request.offsets.astype(np.uint64)

    def _stage(self, block_ids: Any, slots: Any, layout: BlockLayout, rank: int, save: bool) -> int:
        """Check an sm op's arguments and write its index (block ids, then
        slot device addresses) into the next pinned buffer; the block count.
        One libkvcopy call does it for int64-able id arrays; anything it
        refuses goes through check_request, which says what is wrong."""
        check_layout(self.planes, layout, rank)
        blocks, slot_ids = _int64_ids(block_ids), _int64_ids(slots)
        if blocks is not None and slot_ids is not None and blocks.size == slot_ids.size:
            n = int(blocks.size)
            out = self._indexes.reserve(2 * n)
            seg_slots, seen = self._slot_map(layout.slot_stride)
            code = self._lib.kv_stage_index(
                blocks.ctypes.data,
                slot_ids.ctypes.data,
                n,
                self.planes.num_blocks,
                seg_slots.ctypes.data,
                self._dev_bases.ctypes.data,
                seg_slots.size,
                layout.slot_stride,
                rank * layout.shard_bytes,
                2 if save else 1,
                seen.ctypes.data,
                out.ctypes.data,
            )
            if code == 0:
                return n
        request = check_request(self.planes, self.pool, block_ids, slots, layout, rank, save=save)
        n = int(request.blocks.size)  # valid after all: numpy writes the index
        out = self._indexes.reserve(2 * n)
        out[:n] = request.blocks
        out[n:] = self._slot_addresses(request, self._dev_bases).view(np.int64)
        return n

    def _slot_map(self, stride: int) -> tuple[np.ndarray, np.ndarray]:
        """Per slot stride: slots in each pool segment, and a zeroed bitmap
        with a bit per slot or engine block (kv_stage_index's `seen`)."""
        found = self._slot_maps.get(stride)
        if found is None:
            seg_slots = np.array([size // stride for size in self.pool.segment_sizes], np.int64)
            bits = max(int(seg_slots.sum()), self.planes.num_blocks)
            found = self._slot_maps[stride] = (seg_slots, np.zeros(bits // 8 + 1, np.uint8))
        return found

    def _launch_sm(self, index: torch.Tensor, n: int, begin: int, end: int, save: bool) -> None:
        code = self._lib.kv_copy_sm(
            self._index,
            self._plane_addrs_dev.data_ptr(),
            index.data_ptr(),
            n,
            begin,
            end,
            self.planes.chunk_bytes,
            int(save),
            self._ctas[save],
            self.stream.cuda_stream,
        )
        _lib.check(code, "copy_chunks kernel launch")

    def _launch_dma(self, request: CopyRequest, begin: int, end: int, save: bool) -> list:
        """One copy per (plane, block), plane-major; returns the address arrays."""
        chunk = np.uint64(self.planes.chunk_bytes)
        blocks = request.blocks.astype(np.uint64)
        gpu = self._plane_addrs[begin:end, None] + blocks[None, :] * chunk
        host = self._slot_addresses(request, self._host_bases)
        host = host[None, :] + np.arange(begin, end, dtype=np.uint64)[:, None] * chunk
        srcs, dsts = (gpu, host) if save else (host, gpu)
        srcs, dsts = np.ascontiguousarray(srcs.ravel()), np.ascontiguousarray(dsts.ravel())
        used, batch_error = ctypes.c_int(0), ctypes.c_int(0)
        code = self._lib.kv_copy_dma(
            self._index,
            dsts.ctypes.data,
            srcs.ctypes.data,
            self.planes.chunk_bytes,
            srcs.size,
            int(self._try_batch),
            self.stream.cuda_stream,
            ctypes.byref(used),
            ctypes.byref(batch_error),
        )
        _lib.check(code, "DMA copy")
        if batch_error.value:
            self._try_batch = False
            self.batch_error = _lib.error_name(batch_error.value)
        self.dma_kind = "batch" if used.value else "loop"
        return [srcs, dsts]


def _int64_ids(values: Any) -> np.ndarray | None:
    """`values` as a contiguous 1-D int64 array, or None if it is not a 1-D
    integer array (check_request then says so)."""
    array = np.asarray(values)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        return None
    return np.ascontiguousarray(array, dtype=np.int64)
