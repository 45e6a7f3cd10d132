"""The router's global index: which worker holds which block.

Two implementations share this interface and one test suite: a radix tree
(`router.radix.RadixTreeIndex`) and a flat hash map (`router.flat.FlatIndex`).
They are pure data structures: no I/O, no threads, no clocks.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple

from router.keys import BlockKey, Worker


class RouterIndexError(ValueError):
    """An event the index cannot apply; the index is unchanged."""


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


class DumpEntry(NamedTuple):
    """One key of a dump: its parent (None: from the root) and its holders."""

    key: BlockKey
    parent: BlockKey | None
    workers: tuple[Worker, ...]


class IndexDump(NamedTuple):
    workers: tuple[Worker, ...]
    """Every known worker, those holding nothing included."""
    entries: list[DumpEntry]
    """Parents before children."""


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
    - `apply_cleared(w)`: `w` holds nothing afterwards but stays known (its
      tree size is 0). `remove_worker(w)` also forgets `w`; unknown `w` is a
      no-op.
    - `find_matches(keys)`: for each worker holding keys[0], the length of
      the longest prefix of `keys` it holds. With `early_exit`, the walk stops
      once at most one worker still matches: that worker's score is then a
      lower bound (enough to pick it, cheaper to compute).
    - `dump()` lists every key parents-first; `restore(dump)` on an empty
      index of the same implementation rebuilds an index with equal answers.
    """

    def __init__(self) -> None:
        self._held: dict[Worker, set[BlockKey]] = {}
        """Per known worker, the blocks it holds."""
        self._sizes: dict[Worker, int] = {}
        """len(self._held[w]), kept so that a match copies it instead of counting."""

    def apply_stored(
        self, worker: Worker, keys: Sequence[BlockKey], parent: BlockKey | None
    ) -> None:
        self.check_parent(worker, parent)
        check_chain(keys, parent, self._parent_key)
        self._link(worker, keys, parent)
        held = self._held.setdefault(worker, set())
        held.update(keys)
        self._sizes[worker] = len(held)

    @abstractmethod
    def _link(self, worker: Worker, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        """Record the validated store of `keys` after `parent` by `worker`."""

    @abstractmethod
    def _parent_key(self, key: BlockKey) -> tuple[bool, BlockKey | None]:
        """(whether `key` is known, its parent)."""

    @abstractmethod
    def _drop(self, key: BlockKey, worker: Worker) -> None:
        """Forget that `worker` holds `key` (already taken out of `_held`)."""

    @abstractmethod
    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores: ...

    @abstractmethod
    def dump(self) -> IndexDump: ...

    @abstractmethod
    def restore(self, dump: IndexDump) -> None:
        """Rebuild from `dump`; the index must be empty (RouterIndexError if not)."""

    def apply_removed(self, worker: Worker, keys: Sequence[BlockKey]) -> None:
        held = self._held.get(worker)
        if held is None:
            if keys:
                raise UnknownBlock(f"worker {worker} holds no blocks; cannot remove {len(keys)}")
            return  # an unknown worker stays unknown (no ghost entry in _sizes)
        missing = [k for k in keys if k not in held]
        if missing:
            raise UnknownBlock(
                f"worker {worker} does not hold {len(missing)} of the {len(keys)} removed "
                f"block(s), first {missing[0].hex()}"
            )
        for key in keys:
            if key in held:  # a key repeated in one event is removed once
                held.discard(key)
                self._drop(key, worker)
        self._sizes[worker] = len(held)

    def apply_cleared(self, worker: Worker) -> None:
        for key in self._held.get(worker, ()):
            self._drop(key, worker)
        self._held[worker] = set()
        self._sizes[worker] = 0

    def remove_worker(self, worker: Worker) -> None:
        if worker in self._held:
            self.apply_cleared(worker)
            del self._held[worker]
            del self._sizes[worker]

    def add_worker(self, worker: Worker) -> None:
        """Make `worker` known with no blocks (a no-op if known)."""
        self._held.setdefault(worker, set())
        self._sizes.setdefault(worker, 0)

    def workers(self) -> dict[Worker, int]:
        """Every known worker and its number of cached blocks."""
        return self._sizes.copy()

    def check_parent(self, worker: Worker, parent: BlockKey | None) -> None:
        held = self._held.get(worker)
        if parent is not None and (held is None or parent not in held):
            raise UnknownParent(f"worker {worker} does not hold parent block {parent.hex()}")

    def check_empty(self) -> None:
        if self._held:
            raise RouterIndexError("restore needs an empty index")

    def restore_workers(self, dump: IndexDump) -> None:
        """Take the dump's workers and who holds what (after `check_empty`)."""
        for w in dump.workers:
            self._held[w] = set()
        for entry in dump.entries:
            for w in entry.workers:
                self._held.setdefault(w, set()).add(entry.key)
        self._sizes = {w: len(keys) for w, keys in self._held.items()}


INDEXES: dict[str, Callable[[], KvIndex]] = {}
"""Implementation name -> constructor, filled by `register`."""


def register(name: str) -> Callable[[type[KvIndex]], type[KvIndex]]:
    def deco(cls: type[KvIndex]) -> type[KvIndex]:
        INDEXES[name] = cls
        return cls

    return deco


def make_index(name: str) -> KvIndex:
    for module in ("router.flat", "router.radix"):  # each registers its class
        importlib.import_module(module)
    try:
        return INDEXES[name]()
    except KeyError:
        raise ValueError(f"unknown index {name!r}; allowed: {', '.join(sorted(INDEXES))}") from None


def walk_scores(
    holders: Callable[[int, BlockKey], set[Worker] | None],
    keys: Sequence[BlockKey],
    early_exit: bool,
) -> dict[Worker, int]:
    """Shared matching loop: `holders(i, key)` gives the workers holding the
    i-th query key in sequence (None: nobody); a worker's score is the
    position where it first drops out."""
    scores: dict[Worker, int] = {}
    if not keys:
        return scores
    first = holders(0, keys[0])
    if not first:
        return scores
    active = set(first)
    for i in range(1, len(keys)):
        if early_exit and len(active) <= 1:
            break
        here = holders(i, keys[i])
        if not here:
            break
        if active <= here:  # the common case: nobody drops out here
            continue
        dropped = active - here
        for w in dropped:
            scores[w] = i
        active -= dropped
        if not active:
            return scores
    else:
        i = len(keys)
    for w in active:  # matched up to the position the walk stopped at
        scores[w] = i
    return scores


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
