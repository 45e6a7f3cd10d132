"""The parts of `cuda_ext.gpu` that are not the copier: the handle of a
queued copy (`GpuCopyHandle`, its CUDA events), the process-wide pinning of
pool segments (`REGISTRATIONS`), the caller's raw stream and the id check of
the sm path. Imported from `cuda_ext.gpu`, which re-exports `GpuCopyHandle`.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from cuda_ext import _lib
from cuda_ext.layouts import KVPlanes

__all__ = ["REGISTRATIONS", "GpuCopyHandle", "current_stream", "int64_ids", "layer_groups"]


class _Registrations:
    """cudaHostRegister once per process per segment, however many copiers
    use it; unregistered when the last of them closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (address, bytes) -> [device pointer, copiers using it, whether we registered it]
        self._entries: dict[tuple[int, int], list[Any]] = {}

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


REGISTRATIONS = _Registrations()
"""The process's: every copier pins its pool's segments through it."""

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: int) -> int:
    """The raw cudaStream_t of the current stream of `device`."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


class GpuCopyHandle:
    """A copy queued on a copier's stream; one CUDA event per group of planes
    (libkvcopy's, destroyed with the handle)."""

    def __init__(self, device: torch.device, events: np.ndarray, event_of_layer: list[int]) -> None:
        self._index = device.index if device.index is not None else 0
        self._lib = _lib.load()
        self._events = events  # uint64 cudaEvent_t handles, in plane order
        self._event_of_layer = event_of_layer

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current stream) wait until model layer
        `layer` has landed; returns at once. Layers land in order."""
        self._wait(self._events[self._event(layer)], stream)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the whole copy."""
        self._wait(self._events[-1], stream)

    def synchronize_layer(self, layer: int) -> None:
        """Block the host until layer `layer` has landed."""
        event = self._events[self._event(layer)]
        code = self._lib.kv_event_synchronize(self._index, int(event))
        _lib.check(code, "cudaEventSynchronize")

    def synchronize(self) -> None:
        """Block the host until the whole copy is done."""
        code = self._lib.kv_event_synchronize(self._index, int(self._events[-1]))
        _lib.check(code, "cudaEventSynchronize")

    def query(self) -> bool:
        """Whether the whole copy is done."""
        return self._query(self._events[-1])

    def query_layer(self, layer: int) -> bool:
        """Whether model layer `layer` has landed."""
        return self._query(self._events[self._event(layer)])

    def _query(self, event: np.uint64) -> bool:
        code = self._lib.kv_event_query(self._index, int(event))
        if code == _lib.NOT_READY:
            return False
        _lib.check(code, "cudaEventQuery")
        return True

    def _wait(self, event: np.uint64, stream: torch.cuda.Stream | None) -> None:
        # A raw stream of 0 is the default stream of whichever device is
        # current: libkvcopy makes the stream's own device current first.
        if stream is None:
            device, raw = self._index, current_stream(self._index)
        else:
            device, raw = stream.device_index, int(stream.cuda_stream)
        code = self._lib.kv_stream_wait_event(device, raw, int(event))
        _lib.check(code, "cudaStreamWaitEvent")

    def _event(self, layer: int) -> int:
        if isinstance(layer, bool) or not 0 <= layer < len(self._event_of_layer):
            raise ValueError(f"layer {layer} out of range 0..{len(self._event_of_layer) - 1}")
        return self._event_of_layer[layer]

    def __del__(self) -> None:
        # Destroying an event still pending is allowed: CUDA frees it once it
        # completes, and streams already waiting on it still wait.
        events = getattr(self, "_events", None)
        if events is not None and events.size:
            self._events = events[:0]
            self._lib.kv_events_destroy(self._index, events.ctypes.data, events.size)


def int64_ids(values: Any) -> np.ndarray | None:
    """`values` as a contiguous 1-D int64 array, or None if it is not a 1-D
    integer array (check_request then says so)."""
    array = np.asarray(values)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        return None
    return np.ascontiguousarray(array, dtype=np.int64)


def layer_groups(
    planes: KVPlanes, layer_events: bool, n: int, group_bytes: int
) -> tuple[np.ndarray, list[int]]:
    """Where each launch's plane range ends (int64), one range after another
    from plane 0, and which range completes each layer: whole layers, at
    least `group_bytes` of `n` blocks each (`layer_events` False: one range)."""
    ends = planes.layer_ends
    if not layer_events:
        group_ends, event_of_layer = [len(planes.planes)], [0] * len(ends)
    else:
        distinct = sorted(set(ends))
        plane_bytes = n * planes.chunk_bytes
        group_ends, begin = [], 0
        for end in distinct:
            if (end - begin) * plane_bytes >= group_bytes or end == distinct[-1]:
                group_ends.append(end)
                begin = end
        event_of_layer = [next(i for i, g in enumerate(group_ends) if g >= e) for e in ends]
    return np.array(group_ends, np.int64), event_of_layer
