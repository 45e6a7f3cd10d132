"""The CPU-tier block pool: shared-memory segments mapped into this process.

The sidecar creates the segments (`ShmPool.create`) and every engine shim maps
the same ones (`ShmPool.attach`). Slots are carved out later, at a stride the
sidecar learns when the first engine registers its layout; a slot never
straddles two segments.

Segments are POSIX shm (4 KiB pages on a default /dev/shm), or, given a
`directory`, files on a hugetlbfs mount or a tmpfs mounted with huge=always
or within_size, so that the pool is backed by huge pages: each is one
physically contiguous DMA segment, and O_DIRECT reads into them ran 1.2-2x
faster here than into scattered 4 KiB pages. Their names (`shm.names`) tell
`attach` which kind they are; `page_kind` says what the mappings actually got.

Lifetimes:
- Mappings live as long as the pool object (or the last `slot_view` /
  `segment_view` array taken from it): `close()` unmaps at once when no such
  array is alive, otherwise the mapping goes with the last of them. Our fd
  of each segment is closed right after it is mapped; Python's mmap keeps a
  duplicate of it open until the mapping is closed.
- Segments (names in /dev/shm, or files) outlive every process until unlinked. The
  creator unlinks them (`unlink()`, or leaving a `with` block of a created
  pool). Attached pools never unlink. A sidecar that died without unlinking
  leaves its segments behind; its successor calls `remove_stale_segments`
  once it holds the lock that proves no live instance owns the prefix.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from shm.layout import PAGE_BYTES
from shm.names import (
    SHM_DIR,
    is_file_path,
    remove_stale_segments,
    segment_name,
    validate_name,
    validate_prefix,
)
from shm.pages import PageReport, page_report
from shm.segments import (
    SEGMENT_MODE,
    ShmPoolError,
    check_room,
    open_segment,
    place_of,
    remove_segment,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

# Linux >= 5.14; the mmap module exports it from Python 3.13.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

__all__ = ["SHM_DIR", "ShmPool", "ShmPoolError", "buffer_view", "remove_stale_segments"]


def buffer_view(block: memoryview | np.ndarray) -> memoryview:
    """A memoryview of `block` (a slot view, or an array holding a block's
    bytes). Typed here once: numpy's stubs say an ndarray exports its buffer
    only from Python 3.12 on."""
    return memoryview(cast("Buffer", block))


@dataclass
class _Segment:
    name: str
    size: int
    mapping: mmap.mmap
    address: int


def _map(name: str, fd: int, size: int) -> _Segment:
    mapping = mmap.mmap(fd, size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return _Segment(name, size, mapping, address)


def _prefault(fd: int, segment: _Segment, start: int, length: int) -> str:
    """Allocate every page of bytes [start, start + length) of the segment
    (ENOSPC here is an error, not a SIGBUS later) and map it; returns how.
    First touch of a tmpfs page costs ~1 GB/s, a faulted page is copied at
    ~16 GB/s. `start` and `length` are whole pages."""
    os.posix_fallocate(fd, start, length)
    try:
        segment.mapping.madvise(MADV_POPULATE_WRITE, start, length)
        return "fallocate+populate"
    except OSError:  # kernel older than 5.14: touch one byte per page instead
        pages = np.frombuffer(segment.mapping, dtype=np.uint8, count=length, offset=start)
        pages[::PAGE_BYTES] = 0
        del pages
        return "fallocate+touch"


PrefaultProgress = Callable[[int, int], None]
"""Called as the pool is prefaulted: (bytes done, bytes in all)."""


class ShmPool:
    """Shared-memory segments mapped read/write, addressed as slots of a given stride.

    Build with `create` (sidecar) or `attach` (engine). Slot numbers run
    through the segments in order: segment k holds floor(size_k / stride)
    slots, and the bytes past the last whole slot of a segment are unused.
    """

    def __init__(
        self,
        segments: Sequence[_Segment],
        *,
        owner: bool,
        prefault_seconds: float = 0.0,
        prefault_method: str = "none",
    ) -> None:
        self._segments = list(segments)
        self._names = tuple(s.name for s in segments)
        self._sizes = tuple(s.size for s in segments)
        self._tables: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        """Per slot stride: each segment's end and first slot, and the total."""
        self.owner = owner
        self.prefault_seconds = prefault_seconds
        self.prefault_method = prefault_method
        self.pages: PageReport = page_report([(s.address, s.size) for s in segments])
        """What the mappings got when the pool was built (`shm.pages`): for a
        tmpfs pool, `huge_bytes` is complete only if it was prefaulted."""
        self.closed = False
        self._unlinked = False

    @classmethod
    def create(
        cls,
        prefix: str,
        nbytes: int,
        *,
        directory: str | None = None,
        segment_bytes: int = 1 << 30,
        prefault: bool = True,
        progress: PrefaultProgress | None = None,
        progress_bytes: int = 256 << 20,
        mode: int = SEGMENT_MODE,
        gid: int | None = None,
    ) -> ShmPool:
        """Create segments `{prefix}.0`, `{prefix}.1`, ... (`mode`) holding at
        least `nbytes`, each at most `segment_bytes`: POSIX shm `/{prefix}.N`, or
        with `directory` (absolute; a hugetlbfs or tmpfs mount) files
        `{directory}/{prefix}.N`. Sizes are whole pages: 4 KiB for POSIX shm,
        huge pages (`Place.page_bytes`) in a directory, which `segment_bytes`
        must then be a multiple of.

        With `prefault`, every page is allocated and mapped at once, in parts
        of about `progress_bytes` (whole pages), each followed by a call of
        `progress(bytes done, bytes in all)`: a large pool takes seconds.

        Each segment is created 0600, then given to group `gid` (if set) and
        only then `mode` (say 0660 to let that group map it): nobody else
        can open it before it has both.

        Raises ShmPoolError if a segment of that name exists, the directory is
        not on tmpfs or hugetlbfs, or the space (or the huge pages) is lacking;
        on any failure the segments created so far are unlinked.
        """
        validate_prefix(prefix)
        _check_positive("nbytes", nbytes)
        _check_positive("segment_bytes", segment_bytes)
        place = place_of(directory)
        page = place.page_bytes
        if segment_bytes % page:
            raise ValueError(f"segment_bytes must be a multiple of {page} in {place.fs}")
        _check_positive("progress_bytes", progress_bytes)
        if mode & ~0o666:
            raise ValueError(f"segment mode {mode:#o} may only hold read and write bits")
        part = max(page, progress_bytes - progress_bytes % page)
        total = -(-nbytes // page) * page
        check_room(place, total)
        sizes = [segment_bytes] * (total // segment_bytes)
        if total % segment_bytes:
            sizes.append(total % segment_bytes)
        segments: list[_Segment] = []
        created: list[str] = []
        seconds, method, done = 0.0, "none", 0
        try:
            for i, size in enumerate(sizes):
                name = segment_name(prefix, i, directory)
                with open_segment(name, create=True) as fd:
                    created.append(name)
                    if gid is not None:
                        os.fchown(fd, -1, gid)
                    os.fchmod(fd, mode)  # also: the umask may have narrowed it
                    os.ftruncate(fd, size)
                    segments.append(_map(name, fd, size))
                    for start in range(0, size if prefault else 0, part):
                        length = min(part, size - start)
                        began = time.perf_counter()
                        method = _prefault(fd, segments[-1], start, length)
                        seconds += time.perf_counter() - began
                        done += length
                        if progress is not None:
                            progress(done, total)
        except BaseException as exc:
            for segment in segments:
                segment.mapping.close()
            for name in created:
                remove_segment(name)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM):
                where = directory or SHM_DIR
                raise ShmPoolError(f"out of space in {where} creating {prefix}") from exc
            raise
        return cls(segments, owner=True, prefault_seconds=seconds, prefault_method=method)

    @classmethod
    def attach(cls, names: Sequence[str], segment_bytes: Sequence[int]) -> ShmPool:
        """Map existing segments read/write, POSIX names or file paths as the
        creator's `segment_names` gives them; each must have exactly its listed
        size."""
        if len(names) != len(segment_bytes) or not names:
            raise ValueError("attach needs one size per segment name, and at least one")
        segments: list[_Segment] = []
        try:
            for name, size in zip(names, segment_bytes, strict=True):
                validate_name(name)
                _check_positive("segment size", size)
                with open_segment(name, create=False) as fd:
                    actual = os.fstat(fd).st_size
                    if actual != size:
                        raise ShmPoolError(f"shm segment {name} is {actual} bytes, not {size}")
                    segments.append(_map(name, fd, size))
        except BaseException:
            for segment in segments:
                segment.mapping.close()
            raise
        return cls(segments, owner=False)

    @property
    def page_kind(self) -> str:
        """What backs the mappings: "4k", "thp" or "hugetlbfs" (`shm.pages`)."""
        return self.pages.kind

    @property
    def directory(self) -> str | None:
        """The directory of a directory pool; None for POSIX shm."""
        first = self._names[0]
        return os.path.dirname(first) if is_file_path(first) else None

    @property
    def segment_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def nbytes(self) -> int:
        return sum(self._sizes)

    def num_slots(self, stride: int) -> int:
        """How many slots of `stride` bytes the pool holds."""
        return int(self._slot_counts(stride).sum())

    def slot_locations(self, slots: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
        """(segment index, byte offset in that segment) of each slot, as int64 arrays.

        Raises ValueError, before anything else happens, if `slots` is not a 1-D
        integer array or a slot is out of range."""
        self._check_open()
        ends, firsts, total = self._table(stride)
        slots = np.asarray(slots)
        if slots.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if slots.ndim != 1 or slots.dtype.kind not in "iu":
            raise ValueError(f"slots must be a 1-D integer array, got {slots.dtype} {slots.shape}")
        low, high = id_bounds(slots)
        if low < 0 or high >= total:
            raise ValueError(f"slot out of range 0..{total - 1} at stride {stride}")
        if ends.size == 1:  # one segment: no search
            return np.zeros(slots.size, np.int64), slots.astype(np.int64) * stride
        segments = np.searchsorted(ends, slots, side="right")
        offsets = (slots.astype(np.int64) - firsts[segments]) * stride
        return segments.astype(np.int64), offsets

    def slot_addresses(self, slots: np.ndarray, stride: int) -> np.ndarray:
        """Virtual addresses, in this process, where each slot starts (uint64)."""
        segments, offsets = self.slot_locations(slots, stride)
        bases = np.array([s.address for s in self._segments], dtype=np.uint64)
        addresses: np.ndarray = bases[segments] + offsets.astype(np.uint64)
        return addresses

    def slot_view(self, slot: int, stride: int) -> np.ndarray:
        """A writable uint8 view of one slot's `stride` bytes."""
        segments, offsets = self.slot_locations(np.array([slot]), stride)
        mapping = self._segments[int(segments[0])].mapping
        return np.frombuffer(mapping, dtype=np.uint8, count=stride, offset=int(offsets[0]))

    def slot_views(self, slots: np.ndarray, stride: int) -> list[memoryview]:
        """Writable views of each slot's `stride` bytes: `slot_view` for many
        slots at once, located in one call (256 slots: ~30 us, against ~0.7
        ms one by one)."""
        segments, offsets = self.slot_locations(np.asarray(slots), stride)
        maps = [memoryview(s.mapping) for s in self._segments]
        return [
            maps[g][o : o + stride]
            for g, o in zip(segments.tolist(), offsets.tolist(), strict=True)
        ]

    def populate(self) -> float:
        """Map every page of the pool into this process now, so that first
        accesses (an attached pool's first copies, O_DIRECT pinning) take no
        page faults; the bytes are not changed. Returns the seconds it took
        (~0.1 s per GiB of 4 KiB pages here; the faults it saves cost about
        half that when taken during copies instead)."""
        self._check_open()
        start = time.perf_counter()
        for segment in self._segments:
            try:
                # Read-populating a shared shmem mapping maps its pages writable.
                segment.mapping.madvise(MADV_POPULATE_READ)
            except OSError:  # kernel older than 5.14: read one byte per page
                pages = np.frombuffer(segment.mapping, dtype=np.uint8)
                int(pages[::PAGE_BYTES].sum())
                del pages
        return time.perf_counter() - start

    def segment_view(self, index: int) -> np.ndarray:
        """A writable uint8 view of a whole segment."""
        self._check_open()
        if not 0 <= index < len(self._segments):
            raise ValueError(f"segment {index} out of range 0..{len(self._segments) - 1}")
        return np.frombuffer(self._segments[index].mapping, dtype=np.uint8)

    def close(self) -> None:
        """Unmap every segment (idempotent); the segments themselves remain."""
        if self.closed:
            return
        self.closed = True
        for segment in self._segments:
            # Views still alive keep the mapping until the last of them goes.
            with contextlib.suppress(BufferError):
                segment.mapping.close()
        self._segments = []

    def unlink(self) -> None:
        """Remove the segments' names (idempotent); for the creator only.
        Processes that have them mapped keep their mappings."""
        if self._unlinked:
            return
        self._unlinked = True
        for name in self._names:
            remove_segment(name)

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close; a created pool is also unlinked."""
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"ShmPool({len(self._names)} segments, {self.nbytes:,} bytes, {state})"

    def _table(self, stride: int) -> tuple[np.ndarray, np.ndarray, int]:
        table = self._tables.get(stride)
        if table is None:
            counts = self._slot_counts(stride)
            ends = np.cumsum(counts)
            table = self._tables[stride] = (ends, ends - counts, int(counts.sum()))
        return table

    def _slot_counts(self, stride: int) -> np.ndarray:
        _check_positive("stride", stride)
        if stride % PAGE_BYTES:
            raise ValueError(f"stride must be a multiple of {PAGE_BYTES} so slots stay aligned")
        return np.array([size // stride for size in self._sizes], dtype=np.int64)

    def _check_open(self) -> None:
        if self.closed:
            raise ShmPoolError("the pool is closed")


def id_bounds(ids: np.ndarray) -> tuple[int, int]:
    """(lowest, highest) of a non-empty 1-D integer array: through Python
    ints for a few ids (numpy's min() and max() cost ~0.7 us each on a tiny
    array, a large share of a one-block copy's checks), numpy's for more."""
    if ids.size <= 16:
        values = ids.tolist()
        return min(values), max(values)
    return int(ids.min()), int(ids.max())


def _check_positive(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
