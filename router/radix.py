"""RadixTreeIndex: the global index as a tree of blocks.

One node per block key; a node's children are the blocks stored as its
continuation, and its `holders` the workers holding it. A match walks the
tree from the root, so it also checks that the query's keys form a chain the
publishers reported. A node nobody holds stays while it has children (a hole
left by a removal in the middle of a chain) and is pruned with its last child.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.index import Holder, KvIndex, OverlapScores, register
from router.keys import BlockKey


class _Node:
    __slots__ = ("children", "holders", "key", "parent")

    def __init__(self, key: BlockKey | None, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[BlockKey, _Node] = {}
        self.holders: set[Holder] = set()


@register("radix")
class RadixTreeIndex(KvIndex):
    def _reset_entries(self) -> None:
        self._root = _Node(None, None)
        self._nodes: dict[BlockKey, _Node] = {}

    def _link(self, holder: Holder, keys: Sequence[BlockKey], parent: BlockKey | None) -> None:
        cur = self._root if parent is None else self._nodes[parent]
        for key in keys:
            node = self._nodes.get(key)
            if node is None:
                node = _Node(key, cur)
                cur.children[key] = node
                self._nodes[key] = node
            node.holders.add(holder)
            cur = node

    def _parent_key(self, key: BlockKey) -> tuple[bool, BlockKey | None]:
        node = self._nodes.get(key)
        if node is None:
            return False, None
        assert node.parent is not None
        return True, node.parent.key

    def _drop(self, key: BlockKey, holder: Holder) -> None:
        node = self._nodes[key]
        node.holders.discard(holder)
        while node.parent is not None and not node.holders and not node.children:
            assert node.key is not None
            del node.parent.children[node.key]
            del self._nodes[node.key]
            node = node.parent

    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores:
        cur = self._root

        def holders(_: int, key: BlockKey) -> set[Holder] | None:
            nonlocal cur
            child = cur.children.get(key)
            if child is None:
                return None
            cur = child
            return child.holders

        return self._scores(holders, keys, early_exit)

    def _entries(self) -> list[tuple[BlockKey, BlockKey | None, set[Holder]]]:
        entries: list[tuple[BlockKey, BlockKey | None, set[Holder]]] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            assert node.key is not None and node.parent is not None
            entries.append((node.key, node.parent.key, node.holders))
            stack.extend(node.children.values())
        return entries

    def _restore_entries(
        self, entries: list[tuple[BlockKey, BlockKey | None, set[Holder]]]
    ) -> None:
        for key, parent, holders in entries:
            up = self._root if parent is None else self._nodes[parent]
            node = _Node(key, up)
            up.children[key] = node
            self._nodes[key] = node
            node.holders = holders
