"""NativeIndex: the router's default index, its data in C (router/_cindex.c).

One pool entry per known block key (the key, its parent, how many keys
continue it, and a bitmap of the holder slots holding it) behind an
open-addressing table: about 50 bytes per known key and no Python object
per key, so ingesting, matching and the garbage collector all stay off the
millions of objects the Python indexes hold. A holder slot is one
incarnation of a worker: clearing or removing a worker retires its slot in
O(1), queries mask retired slots out, and `sweep` clears their bits in
bounded slices (a slot is reused once swept).

It keeps the contracts of `KvIndex` (router/index.py) exactly; the Python
indexes (router.flat, router.radix) stay as the readable reference the
test suites compare it with.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.dump import IndexDump, check_dump
from router.index import (
    SWEEP_SLICE,
    Holder,
    KeyConflict,
    KvIndex,
    OverlapScores,
    UnknownBlock,
    UnknownParent,
    register,
)
from router.keys import BlockKey, Worker, WorkerId

try:
    from router._cindex import Index as _CIndex
except ImportError:  # the optional extension was not built
    _CIndex = None  # type: ignore[misc, assignment]


class NativeIndex(KvIndex):
    def __init__(self) -> None:
        if _CIndex is None:
            raise RuntimeError(
                "the native router index needs the C extension router._cindex: build it "
                "with `python setup.py build_ext --inplace` (or pip install the package), "
                "or choose --index flat"
            )
        super().__init__()

    def _reset_entries(self) -> None:
        assert _CIndex is not None
        self._c = _CIndex()
        self._names: list[Worker | None] = []
        """Slot -> its live worker (None: retired or free), for `find`."""

    # The base class's per-holder key dicts (_held) stay empty: the C index
    # knows which slot holds which key.

    def apply_stored(
        self, worker: Worker, keys: Sequence[BlockKey], parent: BlockKey | None
    ) -> None:
        self.check_parent(worker, parent)
        new = worker not in self._holder
        holder = self._live(worker)
        size = self._c.store(holder, keys, parent)
        if size < 0 and self._c.stale():
            # The conflicting key may be known through stale entries only:
            # sweep them all (rare: conflicts are collisions) and try again.
            self.sweep_all()
            size = self._c.store(holder, keys, parent)
        if size < 0:
            if new:  # a failed store leaves the worker unknown, as it was
                self._retire(worker)
                del self._sizes[worker]
            if len(set(keys)) != len(keys):
                raise KeyConflict("a stored run repeats a key")
            raise KeyConflict("a stored block is already stored under another parent")
        self._sizes[worker] = size

    def apply_removed(self, worker: Worker, keys: Sequence[BlockKey]) -> None:
        holder = self._holder.get(worker)
        if holder is None:
            if keys:
                raise UnknownBlock(f"worker {worker} holds no blocks; cannot remove {len(keys)}")
            return
        size = self._c.remove(holder, keys)
        if size < 0:
            missing = [k for k in keys if not self._c.holds(holder, k)]
            raise UnknownBlock(
                f"worker {worker} does not hold {len(missing)} of the {len(keys)} removed "
                f"block(s), first {missing[0].hex()}"
            )
        self._sizes[worker] = size

    def check_parent(self, worker: Worker, parent: BlockKey | None) -> None:
        if parent is None:
            return
        holder = self._holder.get(worker)
        if holder is None or not self._c.holds(holder, parent):
            raise UnknownParent(f"worker {worker} does not hold parent block {parent.hex()}")

    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores:
        return OverlapScores(self._c.find(keys, self._names, early_exit), self._sizes.copy())

    @property
    def stale_blocks(self) -> int:
        return int(self._c.stale())

    def sweep(self, max_blocks: int = SWEEP_SLICE) -> bool:
        return bool(self._c.sweep(max_blocks))

    def restore(self, dump: IndexDump) -> None:
        check_dump(dump)
        self._reset()
        for w in dump.workers:
            self._live(w)
        holders = self._holder
        load = self._c.load
        for e in dump.entries:
            load(e.key, e.parent, [holders[w] for w in e.workers])
        self._sizes = {w: int(self._c.size(h)) for w, h in holders.items()}

    def remove_worker(self, worker_id: WorkerId) -> None:
        for w in self._ranks(worker_id):
            self._retire(w)
            del self._sizes[w]

    def known_keys(self) -> int:
        """Keys the index knows (held, holes, and stale ones not swept)."""
        return int(self._c.known())

    def memory_bytes(self) -> int:
        """Bytes the C index has allocated."""
        return int(self._c.memory())

    # The hooks of KvIndex, on the C index.

    def _live(self, worker: Worker) -> Holder:
        holder = self._holder.get(worker)
        if holder is None:
            holder = Holder(self._c.new_slot())
            self._holder[worker] = holder
            self._worker[holder] = worker
            names = self._names
            names.extend([None] * (holder + 1 - len(names)))
            names[holder] = worker
            self._sizes[worker] = 0
        return holder

    def _retire(self, worker: Worker) -> None:
        holder = self._holder.pop(worker)
        del self._worker[holder]
        self._names[holder] = None
        self._c.retire(holder)

    def _link(self, holder: Holder, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        if self._c.store(holder, keys, parent) < 0:
            raise KeyConflict("a stored block is already stored under another parent")

    def _parent_key(self, key: BlockKey) -> tuple[bool, BlockKey | None]:
        known, parent = self._c.parent_of(key)
        return bool(known), parent

    def _drop(self, key: BlockKey, holder: Holder) -> None:
        if self._c.remove(holder, [key]) < 0:
            raise UnknownBlock(f"slot {holder} does not hold block {key.hex()}")

    def _entries(self) -> list[tuple[BlockKey, BlockKey | None, set[Holder]]]:
        rows = self._c.entries()
        parent = {key: up for key, up, _ in rows}
        depth: dict[BlockKey, int] = {}
        for key in parent:
            chain = []
            cur: BlockKey | None = key
            while cur is not None and cur not in depth:
                chain.append(cur)
                cur = parent[cur]
            base = -1 if cur is None else depth[cur]
            for i, k in enumerate(reversed(chain), 1):
                depth[k] = base + i
        rows.sort(key=lambda row: depth[row[0]])
        return [(key, up, set(map(Holder, slots))) for key, up, slots in rows]

    def _restore_entries(
        self, entries: list[tuple[BlockKey, BlockKey | None, set[Holder]]]
    ) -> None:
        for key, parent, holders in entries:
            self._c.load(key, parent, sorted(holders))


if _CIndex is not None:  # without the extension, "native" is not an index name
    register("native")(NativeIndex)
