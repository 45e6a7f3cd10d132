"""RadixTreeIndex: the global index as a tree of blocks.

One node per block key; a node's children are the blocks stored as its
continuation, and its `workers` the workers holding it. A match walks the
tree from the root, so it also checks that the query's keys form a chain the
publishers reported. A node nobody holds stays while it has children (a hole
left by a removal in the middle of a chain) and is pruned with its last child.
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


class _Node:
    __slots__ = ("children", "key", "parent", "workers")

    def __init__(self, key: BlockKey | None, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[BlockKey, _Node] = {}
        self.workers: set[Worker] = set()


@register("radix")
class RadixTreeIndex(KvIndex):
    def __init__(self) -> None:
        super().__init__()
        self._root = _Node(None, None)
        self._nodes: dict[BlockKey, _Node] = {}

    def _link(self, worker: Worker, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        cur = self._root if parent is None else self._nodes[parent]
        for key in keys:
            node = self._nodes.get(key)
            if node is None:
                node = _Node(key, cur)
                cur.children[key] = node
                self._nodes[key] = node
            node.workers.add(worker)
            cur = node

    def _parent_key(self, key: BlockKey) -> tuple[bool, BlockKey | None]:
        node = self._nodes.get(key)
        if node is None:
            return False, None
        assert node.parent is not None
        return True, node.parent.key

    def _drop(self, key: BlockKey, worker: Worker) -> None:
        node = self._nodes[key]
        node.workers.discard(worker)
        while node.parent is not None and not node.workers and not node.children:
            assert node.key is not None
            del node.parent.children[node.key]
            del self._nodes[node.key]
            node = node.parent

    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores:
        cur = self._root

        def holders(_: int, key: BlockKey) -> set[Worker] | None:
            nonlocal cur
            child = cur.children.get(key)
            if child is None:
                return None
            cur = child
            return child.workers

        return OverlapScores(walk_scores(holders, keys, early_exit), self.workers())

    def dump(self) -> IndexDump:
        entries: list[DumpEntry] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            assert node.key is not None and node.parent is not None
            entries.append(DumpEntry(node.key, node.parent.key, tuple(sorted(node.workers))))
            stack.extend(node.children.values())
        return IndexDump(tuple(sorted(self._held)), entries)

    def restore(self, dump: IndexDump) -> None:
        self.check_empty()
        for key, parent, workers in dump.entries:
            up = self._root if parent is None else self._nodes[parent]
            node = _Node(key, up)
            up.children[key] = node
            self._nodes[key] = node
            node.workers.update(workers)
        self.restore_workers(dump)
