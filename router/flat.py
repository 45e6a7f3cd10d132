"""FlatIndex: the global index as one hash map from block key to holders.

A match is one dict lookup per query key, with no tree to walk: it trusts the
keys to be chained hashes (a key names its whole prefix), which both the
sidecar's keys and vLLM's block hashes are. Each key also remembers its parent
while anyone holds it or a key below it is still known (a hole left by a
removal in the middle of a chain, as in the tree), so stores are validated
the same way as in the tree and a key can never be stored below itself.

Holder sets are interned: every key held by the same holders points at one
shared frozenset, and adding or dropping a holder is a cached transition
from one interned set to the next. Keys of a long shared prefix then share
one set (8 bytes each instead of a set object each), and a match walking
them sees the same object again and again, which it skips by identity.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from router.index import Holder, KvIndex, OverlapScores, register
from router.keys import BlockKey, Worker

Holders = frozenset[Holder]
_EMPTY: Holders = frozenset()
MAX_TRANSITIONS = 1 << 16
"""Cached transitions kept before the caches start over (holders retired
long ago must not keep theirs forever); a fresh cache only re-interns."""


class HolderSets:
    """The interned holder sets and the transitions between them."""

    def __init__(self) -> None:
        self._canonical: dict[Holders, Holders] = {_EMPTY: _EMPTY}
        self._plus: dict[Holder, dict[Holders, Holders]] = {}
        self._minus: dict[Holder, dict[Holders, Holders]] = {}
        self._cached = 0

    def intern(self, holders: Holders) -> Holders:
        return self._canonical.setdefault(holders, holders)

    def plus(self, holder: Holder) -> dict[Holders, Holders]:
        """set -> set | {holder}, filled as `add` is called."""
        self._bound()
        return self._plus.setdefault(holder, {})

    def minus(self, holder: Holder) -> dict[Holders, Holders]:
        """set -> set - {holder}, filled as `discard` is called."""
        self._bound()
        return self._minus.setdefault(holder, {})

    def add(self, table: dict[Holders, Holders], old: Holders, holder: Holder) -> Holders:
        new = table[old] = self.intern(old | {holder})
        self._cached += 1
        return new

    def discard(self, table: dict[Holders, Holders], old: Holders, holder: Holder) -> Holders:
        new = table[old] = self.intern(old - {holder})
        self._cached += 1
        return new

    def _bound(self) -> None:
        if self._cached > MAX_TRANSITIONS:
            self._canonical = {_EMPTY: _EMPTY}
            self._plus, self._minus = {}, {}
            self._cached = 0


@register("flat")
class FlatIndex(KvIndex):
    def _reset_entries(self) -> None:
        self._sets = HolderSets()
        self._holders: dict[BlockKey, Holders] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        """Every known key: held by someone, or a hole with known keys below it."""
        self._children: dict[BlockKey, int] = {}
        """Known key -> how many known keys continue it (absent: none)."""

    def _link(self, holder: Holder, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        up = parent
        holders, sets = self._holders, self._sets
        plus = sets.plus(holder)
        known = self._parent
        for key in keys:
            old = holders.get(key, _EMPTY)
            new = plus.get(old)
            if new is None:
                new = sets.add(plus, old, holder)
            holders[key] = new
            if key not in known:
                self._know(key, up)
            up = key

    def _know(self, key: BlockKey, parent: BlockKey | None) -> None:
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def _parent_key(self, key: BlockKey) -> tuple[bool, BlockKey | None]:
        if key in self._parent:
            return True, self._parent[key]
        return False, None

    def _drop(self, key: BlockKey, holder: Holder) -> None:
        old = self._holders[key]
        minus = self._sets.minus(holder)
        new = minus.get(old)
        if new is None:
            new = self._sets.discard(minus, old, holder)
        if new:
            self._holders[key] = new
            return
        del self._holders[key]
        cur: BlockKey | None = key
        while cur is not None and cur not in self._holders and cur not in self._children:
            up = self._parent.pop(cur)  # forget it, then maybe its parent (a hole)
            if up is not None:
                left = self._children[up] - 1
                if left:
                    self._children[up] = left  # in place: a re-insert would grow the dict
                else:
                    del self._children[up]
            cur = up

    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores:
        """`walk_scores` specialised: one dict lookup per key, and a key
        whose (interned) holder set is the one seen last costs nothing more."""
        sizes = self._sizes.copy()
        get = self._holders.get
        first = get(keys[0]) if keys else None
        if not first:
            return OverlapScores({}, sizes)
        live = self._worker
        active: Set[Holder] = live.keys() & first if self._stale else first
        scores: dict[Worker, int] = {}
        seen, stop = first, len(keys)
        if early_exit and len(active) <= 1:
            stop = 1
        else:
            for i, key in enumerate(keys[1:], 1):
                here = get(key)
                if here is seen:
                    continue
                if not here:
                    stop = i
                    break
                seen = here
                if active <= here:
                    continue
                for h in active - here:
                    scores[live[h]] = i
                active = active & here
                if not active:
                    stop = i
                    break
                if early_exit and len(active) <= 1:
                    stop = i + 1
                    break
        matched = dict.fromkeys(map(live.__getitem__, active), stop)
        if scores:
            matched.update(scores)
        return OverlapScores(matched, sizes)

    def _entries(self) -> list[tuple[BlockKey, BlockKey | None, set[Holder]]]:
        depth: dict[BlockKey, int] = {}
        for key in self._parent:
            chain = []
            cur: BlockKey | None = key
            while cur is not None and cur in self._parent and cur not in depth:
                chain.append(cur)
                cur = self._parent[cur]
            base = depth.get(cur, -1) if cur is not None else -1
            for i, k in enumerate(reversed(chain)):
                depth[k] = base + 1 + i
        order = sorted(self._parent, key=depth.__getitem__)
        return [(k, self._parent[k], set(self._holders.get(k, _EMPTY))) for k in order]

    def _restore_entries(
        self, entries: list[tuple[BlockKey, BlockKey | None, set[Holder]]]
    ) -> None:
        for key, parent, holders in entries:
            if holders:
                self._holders[key] = self._sets.intern(frozenset(holders))
            self._know(key, parent)
