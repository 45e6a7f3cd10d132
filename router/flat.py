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

from router.index import (
    DumpEntry,
    IndexDump,
    KvIndex,
    OverlapScores,
    register,
    walk_scores,
)
from router.keys import BlockKey, Worker


@register("flat")
class FlatIndex(KvIndex):
    def __init__(self) -> None:
        super().__init__()
        self._holders: dict[BlockKey, set[Worker]] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        """Every known key: held by someone, or a hole with known keys below it."""
        self._children: dict[BlockKey, int] = {}
        """Known key -> how many known keys continue it (absent: none)."""

    def _link(self, worker: Worker, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        up = parent
        for key in keys:
            self._holders.setdefault(key, set()).add(worker)
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

    def _drop(self, key: BlockKey, worker: Worker) -> None:
        holders = self._holders[key]
        holders.discard(worker)
        if holders:
            return
        del self._holders[key]
        cur: BlockKey | None = key
        while cur is not None and cur not in self._holders and cur not in self._children:
            up = self._parent.pop(cur)  # forget it, then maybe its parent (a hole)
            if up is not None:
                left = self._children.pop(up) - 1
                if left:
                    self._children[up] = left
            cur = up

    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores:
        get = self._holders.get
        scores = walk_scores(lambda _, key: get(key), keys, early_exit)
        return OverlapScores(scores, self.workers())

    def dump(self) -> IndexDump:
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
        entries = [
            DumpEntry(k, self._parent[k], tuple(sorted(self._holders.get(k, ())))) for k in order
        ]
        return IndexDump(tuple(sorted(self._held)), entries)

    def restore(self, dump: IndexDump) -> None:
        self.check_empty()
        for key, parent, workers in dump.entries:
            if workers:
                self._holders[key] = set(workers)
            self._know(key, parent)
        self.restore_workers(dump)
