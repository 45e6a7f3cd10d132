"""FlatIndex: the global index as one hash map from block key to holders.

A match is one dict lookup per query key, with no tree to walk: it trusts the
keys to be chained hashes (a key names its whole prefix), which both the
sidecar's keys and vLLM's block hashes are. Each key also remembers its parent
while anyone holds it or a key below it is still known (a hole left by a
removal in the middle of a chain, as in the tree), so stores are validated
the same way as in the tree and a key can never be stored below itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.index import Holder, KvIndex, OverlapScores, register
from router.keys import BlockKey


@register("flat")
class FlatIndex(KvIndex):
    def _reset_entries(self) -> None:
        self._holders: dict[BlockKey, set[Holder]] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        """Every known key: held by someone, or a hole with known keys below it."""
        self._children: dict[BlockKey, int] = {}
        """Known key -> how many known keys continue it (absent: none)."""

    def _link(self, holder: Holder, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        up = parent
        for key in keys:
            self._holders.setdefault(key, set()).add(holder)
            if key not in self._parent:
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
        holders = self._holders[key]
        holders.discard(holder)
        if holders:
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
        get = self._holders.get
        return self._scores(lambda _, key: get(key), keys, early_exit)

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
        return [(k, self._parent[k], self._holders.get(k, set())) for k in order]

    def _restore_entries(
        self, entries: list[tuple[BlockKey, BlockKey | None, set[Holder]]]
    ) -> None:
        for key, parent, holders in entries:
            if holders:
                self._holders[key] = holders
            self._know(key, parent)
