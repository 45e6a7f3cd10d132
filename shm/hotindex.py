"""The hot index: a geometry's ready CPU-tier blocks, published in shared memory.

The sidecar (one writer, its loop thread) keeps, per block geometry, one
POSIX shm segment that maps each ready block's key to its slot and the
slot's generation; engines map it read-only and look up, and load CPU hits,
without a round trip to the sidecar. The table, its seqlock and the
generation rule are in `_hotindex.c`; in short:

- a slot's generation is bumped whenever the slot stops holding its block
  (`vacate`: freed or retired), before it can be written again;
- a reader takes (slot, gen) from the table, copies the slot, then checks
  the generation again (`check`): unchanged means the bytes copied are the
  block it looked up; changed means a miss from that block on.

Without the C extension (no compiler at install) there is no hot index:
`AVAILABLE` is False, the sidecar publishes nothing and engines use the
protocol for every lookup and load.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from types import ModuleType
from typing import NamedTuple

import numpy as np

from shm.names import SHM_DIR, remove_stale_segments, segment_name
from shm.segments import ShmPoolError, open_segment, remove_segment

try:
    from shm import _hotindex
except ImportError:  # built without a C compiler
    _hotindex = None  # type: ignore[assignment]

AVAILABLE = _hotindex is not None

OPEN = 1
"""Flag: the writer serves this table (cleared when the sidecar stops)."""
LOADS = 2
"""Flag: engines may load CPU hits from the pool without a plan."""
LOWER_TIERS = 4
"""Flag: the geometry has tiers below the CPU one (a CPU miss may still be
a hit there: ask the sidecar)."""
SAVES = 8
"""Flag: engines may save into slots granted ahead (Grant, Commit)."""
OBSERVED = 16
"""Flag: the CPU tier's policy learns from requests (`auto`): engines send
each lookup's whole key chain in their Touch batches."""


def _lib() -> ModuleType:
    if _hotindex is None:
        raise RuntimeError("shm._hotindex is not built")
    return _hotindex


def index_name(shm_prefix: str, geometry: int) -> str:
    """The segment of geometry number `geometry` (POSIX shm, whatever
    `shm_dir` holds the pool: the table is small and needs no huge pages)."""
    return segment_name(f"{shm_prefix}-hot", geometry)


def remove_stale(shm_prefix: str) -> list[str]:
    """Withdraw and unlink the hot indexes a dead sidecar of `shm_prefix`
    left: each is marked closed first, so an engine still mapping it stops
    trusting it at once, not when its stamp gets old. Only for a sidecar
    that holds the instance lock (see `remove_stale_segments`)."""
    prefix = f"{shm_prefix}-hot"
    pattern = re.compile(re.escape(prefix) + r"\.\d+")
    for entry in sorted(os.listdir(SHM_DIR)) if AVAILABLE else ():
        if pattern.fullmatch(entry):
            with (
                contextlib.suppress(OSError, ShmPoolError, ValueError),
                open_segment("/" + entry, create=False) as fd,
            ):
                if os.fstat(fd).st_uid != os.getuid():
                    continue  # another user's file under our name: never written (logged below)
                with mmap.mmap(fd, os.fstat(fd).st_size) as mapping:
                    _lib().withdraw(mapping)
    return remove_stale_segments(prefix)


class HotIndex:
    """The writer's side: create, publish, vacate, move, stamp; close unlinks."""

    def __init__(
        self, name: str, num_slots: int, flags: int, *, mode: int = 0o600, gid: int | None = None
    ) -> None:
        _c = self._c = _lib()
        capacity = 1 << max(4, (2 * max(num_slots, 1) - 1).bit_length())
        size = _c.segment_bytes(capacity, num_slots)
        with open_segment(name, create=True) as fd:
            try:
                if gid is not None:
                    os.fchown(fd, -1, gid)
                os.fchmod(fd, mode)
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            except BaseException:
                remove_segment(name)
                raise
        self.name = name
        self.num_slots = num_slots
        self.flags = flags
        _c.init(self._map, capacity, num_slots, flags, int.from_bytes(os.urandom(8), "little"))
        self.stamp()

    def publish(self, keys: bytes, slots: np.ndarray) -> None:
        """Blocks with these keys are ready in these slots."""
        self._c.publish(self._map, keys, np.ascontiguousarray(slots, dtype=np.int64))

    def vacate(self, slots: np.ndarray) -> None:
        """These slots no longer hold their blocks (freed or retired)."""
        self._c.vacate(self._map, np.ascontiguousarray(slots, dtype=np.int64))

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """The blocks of slots `src` were copied to slots `dst`."""
        s = np.ascontiguousarray(src, dtype=np.int64)
        self._c.move(self._map, s, np.ascontiguousarray(dst, dtype=np.int64))

    def stamp(self) -> None:
        """The writer is alive (readers trust a table stamped recently)."""
        self._c.stamp(self._map, self.flags)

    def close(self) -> None:
        """Withdraw the table (every generation bumped, so a load in flight
        fails its check; flags cleared, so no reader trusts it), unmap, unlink."""
        if self._map.closed:
            return
        self.flags = 0
        self._c.withdraw(self._map)
        self._map.close()
        remove_segment(self.name)


class HotState(NamedTuple):
    flags: int
    age: float
    """Seconds since the writer's last stamp."""
    token: int
    """Random per table: tells a new table under the same name from the old."""


class HotIndexView:
    """A reader's read-only mapping of a hot index."""

    def __init__(self, name: str) -> None:
        self._c = _lib()
        with open_segment(name, create=False, read_only=True) as fd:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        try:
            self.token = self.state().token  # ValueError if it is not a table
        except BaseException:
            self._map.close()
            raise
        self.name = name
        self._slots = np.empty(0, dtype=np.int64)
        self._gens = np.empty(0, dtype=np.uint64)

    def state(self) -> HotState:
        flags, age, token = self._c.state(self._map)
        return HotState(flags, age, token)

    def count(self, keys: bytes) -> int:
        """Leading keys (16 bytes each) whose blocks are ready now."""
        n: int = self._c.probe(self._map, keys)
        return n

    def find(self, keys: bytes) -> tuple[np.ndarray, np.ndarray]:
        """(slots, gens) of the leading keys whose blocks are ready now."""
        n = len(keys) // 16
        if self._slots.size < n:
            self._slots = np.empty(max(n, 2 * self._slots.size), dtype=np.int64)
            self._gens = np.empty(self._slots.size, dtype=np.uint64)
        found = self._c.probe(self._map, keys, self._slots, self._gens)
        return self._slots[:found].copy(), self._gens[:found].copy()

    def check(self, slots: np.ndarray, gens: np.ndarray) -> int:
        """Leading blocks whose slots still hold what `find` saw: call after
        copying them; the bytes copied of the rest may be anything."""
        n: int = self._c.check(self._map, slots, gens)
        return n

    def close(self) -> None:
        self._map.close()
