"""The router's global index: which worker holds which block.

Three implementations share this interface and one test suite: the native
index (`router.native.NativeIndex`, its data in C: the default), a radix
tree (`router.radix.RadixTreeIndex`, the reference the native index is
property-tested against) and a flat hash map (`router.flat.FlatIndex`, the
fastest without the C extension, which is optional to build).
They are pure data structures: no I/O, no threads, no clocks.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence, Set
from typing import NamedTuple, NewType

from router.dump import DumpEntry, IndexDump, RouterIndexError, check_dump
from router.keys import BlockKey, Worker, WorkerId


class UnknownParent(RouterIndexError):
    """A store continues from a block the worker does not hold."""


class UnknownBlock(RouterIndexError):
    """A removal names a block the worker does not hold."""


class KeyConflict(RouterIndexError):
    """A key is already known under a different parent (a hash collision or a
    publisher mixing key kinds)."""


class OverlapScores(NamedTuple):
    scores: dict[Worker, int]
    """Per worker holding the first block: how many leading blocks it holds."""
    tree_sizes: dict[Worker, int]
    """Every known worker's total cached blocks (0 after a clear)."""


Holder = NewType("Holder", int)
"""One incarnation of a worker in the index's entries. Clearing or removing
a worker retires its holder (O(1)): entries naming a retired holder are
stale, invisible to every query, and swept later in bounded slices."""

SWEEP_SLICE = 1000
"""Stale entries `sweep()` drops per call by default (about 1-2 ms)."""


class KvIndex(ABC):
    """Per worker, a set of blocks, each stored as the continuation of a parent.

    Contracts, the same for every implementation:
    - `apply_stored(w, keys, parent)`: keys[0] continues `parent`, keys[i]
      continues keys[i-1]. `parent` must be None or a block `w` holds, else
      UnknownParent and nothing changes. Storing a block `w` already holds is
      a no-op for that block. A key known under another parent: KeyConflict,
      nothing changes.
    - `apply_removed(w, keys)`: every key must be held by `w`, else
      UnknownBlock and nothing changes. Removing a block in the middle of a
      chain keeps the blocks after it; matches for `w` stop at the gap.
    - A worker id is one worker, its data-parallel ranks parts of it (as in
      Dynamo): `apply_cleared(w)` (the Cleared event of rank `w`) leaves every
      rank of `w.worker_id` holding nothing but known (tree size 0);
      `remove_worker(worker_id)` forgets every rank (unknown: a no-op).
      `clear_rank(w)` clears rank `w` alone (a subscriber resetting the
      stream of that rank).
    - Clears and removals are O(1): the worker's entries turn stale at once
      (no query, conflict check or dump sees them) and are dropped by
      `sweep(n)`, n entries per call, which the owner calls between requests.
    - `find_matches(keys)`: for each worker holding keys[0], the length of
      the longest prefix of `keys` it holds. With `early_exit`, the walk stops
      once at most one worker still matches: that worker's score is then a
      lower bound (enough to pick it, cheaper to compute).
    - `dump()` lists every key parents-first; `restore(dump)` checks the whole
      dump first (RouterIndexError and nothing changes if it is not one an
      index could have produced), then replaces the index's contents with it:
      the dump's workers are the known ones, holding exactly its blocks, so an
      empty dump leaves an empty index. Round trips stay within one
      implementation.
    """

    def __init__(self) -> None:
        self._next_holder = 0
        self._reset()

    def _reset(self) -> None:
        """Forget everything (also the stale entries, dropped with the containers)."""
        self._holder: dict[Worker, Holder] = {}
        """Per known worker, its live holder."""
        self._worker: dict[Holder, Worker] = {}
        """The inverse of `_holder`: live holders only."""
        self._held: dict[Holder, dict[BlockKey, None]] = {}
        """Per live holder, the blocks it holds, in the order first stored: a
        block after its parent, so a sweep popping from the end drops children
        before parents and never prunes a long chain at once."""
        self._sizes: dict[Worker, int] = {}
        """len(self._held[holder of w]), kept so that a match copies it instead of counting."""
        self._stale: deque[tuple[Holder, dict[BlockKey, None]]] = deque()
        """Retired holders and the blocks whose entries still name them."""
        self._stale_blocks = 0
        self._reset_entries()

    @abstractmethod
    def _reset_entries(self) -> None:
        """Start the implementation's own containers empty."""

    def apply_stored(
        self, worker: Worker, keys: Sequence[BlockKey], parent: BlockKey | None
    ) -> None:
        self.check_parent(worker, parent)
        self._check_chain(keys, parent)
        holder = self._live(worker)
        self._link(holder, keys, parent)
        held = self._held[holder]
        held.update(dict.fromkeys(keys))
        self._sizes[worker] = len(held)

    @abstractmethod
    def _link(self, holder: Holder, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        """Record the validated store of `keys` after `parent` by `holder`."""

    @abstractmethod
    def _parent_key(self, key: BlockKey) -> tuple[bool, BlockKey | None]:
        """(whether `key` is known, its parent)."""

    @abstractmethod
    def _drop(self, key: BlockKey, holder: Holder) -> None:
        """Forget that `holder` holds `key` (already taken out of `_held`)."""

    @abstractmethod
    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores: ...

    @abstractmethod
    def _entries(self) -> list[tuple[BlockKey, BlockKey | None, set[Holder]]]:
        """Every known key, parents first, with its parent and holders
        (called with no stale entry left)."""

    @abstractmethod
    def _restore_entries(
        self, entries: list[tuple[BlockKey, BlockKey | None, set[Holder]]]
    ) -> None:
        """Load a checked dump's entries, parents first, into the emptied index."""

    def dump(self) -> IndexDump:
        self.sweep_all()  # a dump walks every key anyway
        name = self._worker.__getitem__
        entries = [
            DumpEntry(key, parent, tuple(sorted(map(name, holders))))
            for key, parent, holders in self._entries()
        ]
        return IndexDump(tuple(sorted(self._holder)), entries)

    def restore(self, dump: IndexDump) -> None:
        check_dump(dump)
        self._reset()
        for w in dump.workers:
            self._live(w)
        holders = self._holder
        entries = [(e.key, e.parent, {holders[w] for w in e.workers}) for e in dump.entries]
        self._restore_entries(entries)
        for key, _, held_by in entries:
            for holder in held_by:
                self._held[holder][key] = None
        self._sizes = {w: len(self._held[h]) for w, h in holders.items()}

    def apply_removed(self, worker: Worker, keys: Sequence[BlockKey]) -> None:
        holder = self._holder.get(worker)
        if holder is None:
            if keys:
                raise UnknownBlock(f"worker {worker} holds no blocks; cannot remove {len(keys)}")
            return  # an unknown worker stays unknown (no ghost entry in _sizes)
        held = self._held[holder]
        missing = [k for k in keys if k not in held]
        if missing:
            raise UnknownBlock(
                f"worker {worker} does not hold {len(missing)} of the {len(keys)} removed "
                f"block(s), first {missing[0].hex()}"
            )
        for key in keys:
            if key in held:  # a key repeated in one event is removed once
                del held[key]
                self._drop(key, holder)
        self._sizes[worker] = len(held)

    def apply_cleared(self, worker: Worker) -> None:
        for w in self._ranks(worker.worker_id) | {worker}:
            self.clear_rank(w)

    def clear_rank(self, worker: Worker) -> None:
        if worker in self._holder:
            self._retire(worker)
        self._live(worker)

    def remove_worker(self, worker_id: WorkerId) -> None:
        for w in self._ranks(worker_id):
            self._retire(w)
            del self._sizes[w]

    def add_worker(self, worker: Worker) -> None:
        """Make `worker` known with no blocks (a no-op if known)."""
        self._live(worker)

    def workers(self) -> dict[Worker, int]:
        """Every known worker and its number of cached blocks."""
        return self._sizes.copy()

    @property
    def stale_blocks(self) -> int:
        """Entries of cleared or removed workers not swept yet."""
        return self._stale_blocks

    def sweep(self, max_blocks: int = SWEEP_SLICE) -> bool:
        """Drop up to `max_blocks` stale entries; whether some are left."""
        stale = self._stale
        budget = max_blocks
        while stale and budget > 0:
            holder, keys = stale[0]
            n = min(budget, len(keys))
            pop, drop = keys.popitem, self._drop
            for _ in range(n):
                drop(pop()[0], holder)
            budget -= n
            self._stale_blocks -= n
            if not keys:
                stale.popleft()
        return bool(stale)

    def sweep_all(self) -> None:
        while self.sweep(1 << 30):
            pass

    def check_parent(self, worker: Worker, parent: BlockKey | None) -> None:
        holder = self._holder.get(worker)
        if parent is not None and (holder is None or parent not in self._held[holder]):
            raise UnknownParent(f"worker {worker} does not hold parent block {parent.hex()}")

    def _scores(
        self,
        holders: Callable[[int, BlockKey], Set[Holder] | None],
        keys: Sequence[BlockKey],
        early_exit: bool,
    ) -> OverlapScores:
        scores = walk_scores(holders, keys, early_exit, self._worker, bool(self._stale))
        return OverlapScores(scores, self._sizes.copy())

    def _check_chain(self, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        try:
            check_chain(keys, parent, self._parent_key)
        except KeyConflict:
            if not self._stale:
                raise
            # The conflicting key may be known through stale entries only:
            # sweep them all (rare: conflicts are collisions) and look again.
            self.sweep_all()
            check_chain(keys, parent, self._parent_key)

    def _live(self, worker: Worker) -> Holder:
        """`worker`'s live holder, made (and the worker known) if it has none."""
        holder = self._holder.get(worker)
        if holder is None:
            holder = Holder(self._next_holder)
            self._next_holder += 1
            self._holder[worker] = holder
            self._worker[holder] = worker
            self._held[holder] = {}
            self._sizes[worker] = 0
        return holder

    def _retire(self, worker: Worker) -> None:
        """Forget `worker`'s holder in O(1); its entries go stale."""
        holder = self._holder.pop(worker)
        del self._worker[holder]
        held = self._held.pop(holder)
        if held:
            self._stale.append((holder, held))
            self._stale_blocks += len(held)

    def _ranks(self, worker_id: WorkerId) -> set[Worker]:
        return {w for w in self._holder if w.worker_id == worker_id}


INDEXES: dict[str, Callable[[], KvIndex]] = {}
"""Implementation name -> constructor, filled by `register`."""


def register(name: str) -> Callable[[type[KvIndex]], type[KvIndex]]:
    def deco(cls: type[KvIndex]) -> type[KvIndex]:
        INDEXES[name] = cls
        return cls

    return deco


def default_index() -> str:
    """ "native" where the C extension is built, else "flat"."""
    return "native" if importlib.util.find_spec("router._cindex") else "flat"


def make_index(name: str) -> KvIndex:
    for module in ("router.flat", "router.native", "router.radix"):  # each registers its class
        importlib.import_module(module)
    try:
        return INDEXES[name]()
    except KeyError:
        raise ValueError(f"unknown index {name!r}; allowed: {', '.join(sorted(INDEXES))}") from None


def walk_scores(
    holders: Callable[[int, BlockKey], Set[Holder] | None],
    keys: Sequence[BlockKey],
    early_exit: bool,
    live: Mapping[Holder, Worker],
    stale: bool,
) -> dict[Worker, int]:
    """Shared matching loop: `holders(i, key)` gives the holders of the i-th
    query key in sequence (None: nobody); a worker's score is the position
    where its live holder first drops out. `stale`: whether holder sets may
    name retired holders (those not in `live`), which then never match."""
    scores: dict[Holder, int] = {}
    if not keys:
        return {}
    first = holders(0, keys[0])
    if not first:
        return {}
    active = live.keys() & first if stale else set(first)
    seen = first  # a holder set `active` is known to be within
    for i in range(1, len(keys)):
        if early_exit and len(active) <= 1:
            break
        here = holders(i, keys[i])
        if here is seen:  # the same (interned) set again: nobody drops out
            continue
        if not here:
            break
        if active <= here:  # the common case: nobody drops out here
            seen = here
            continue
        dropped = active - here
        for h in dropped:
            scores[h] = i
        active -= dropped
        seen = here
        if not active:
            break
    else:
        i = len(keys)
    for h in active:  # matched up to the position the walk stopped at
        scores[h] = i
    return {live[h]: n for h, n in scores.items()}


def check_chain(
    keys: Sequence[BlockKey],
    parent: BlockKey | None,
    known_parent: Callable[[BlockKey], tuple[bool, BlockKey | None]],
) -> None:
    """Raise KeyConflict if a key is repeated in `keys` or already known under
    a parent other than the one this store gives it."""
    if len(set(keys)) != len(keys):
        raise KeyConflict("a stored run repeats a key")
    expected = parent
    for key in keys:
        known, up = known_parent(key)
        if known and up != expected:
            raise KeyConflict(f"block {key.hex()} is already stored under another parent")
        expected = key
