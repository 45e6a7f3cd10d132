"""What S3-FIFO and ARC share over radix-index nodes: two queues and their ghosts.

Queue 0 is the one new nodes enter (S3-FIFO's small queue, ARC's recent
one), queue 1 the other (main, frequent). The base counts each queue's
blocks, remembers the first key of each victim `pop` gave from a ghosted
queue (all of the node, or the tail the index cut off), bounds each ghost by
the number of cached nodes (at least `min_ghost_entries`), and keeps
`share`: eviction takes from queue 0 while it holds more than that share of
the blocks. `_adapt` is ARC's step on the share; the subclasses order their
queues and choose their victims.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from contract.ids import KEY_BYTES
from sidecar.control.node import RadixNode
from sidecar.control.policies import EvictionPolicy

SHARE_BOUNDS = (0.01, 0.9)
"""Where an adaptive share stays: queue 0 never vanishes (new nodes always
have a probation queue) and queue 1 always keeps a tenth of the blocks."""


class QueueState(Protocol):
    queue: int

    def copy(self) -> QueueState: ...


class TwoQueues(EvictionPolicy):
    ghost_queues: tuple[int, ...] = (0, 1)
    """The queues whose victims a ghost remembers."""

    ghost_blocks_share: float | None = None
    """When set, each ghost is bounded by the blocks it remembers (this
    share of the cached blocks, as S3-FIFO's paper bounds it in objects)
    instead of by its entries."""

    def __init__(self, min_ghost_entries: int, share: float) -> None:
        self._blocks = [0, 0]
        """Blocks of the nodes in each queue (candidates or not)."""
        self._num_nodes = 0
        self._min_ghost = min_ghost_entries
        self._ghosts: tuple[OrderedDict[bytes, int], OrderedDict[bytes, int]] = (
            OrderedDict(),
            OrderedDict(),
        )
        """First keys of what each queue evicted -> blocks evicted."""
        self._ghost_blocks = [0, 0]
        """Blocks each ghost remembers."""
        self._leaving: RadixNode | None = None
        """The victim `pop` just gave from a ghosted queue: its ghost
        remembers the first key of what the index then evicts of it."""
        self._leaving_queue = 0
        self.share = share

    @staticmethod
    def _state(node: RadixNode) -> QueueState:
        raise NotImplementedError

    @property
    def queue_blocks(self) -> tuple[int, int]:
        """Blocks of the nodes in queue 0 and in queue 1 (candidates or not)."""
        return self._blocks[0], self._blocks[1]

    def _back_from_ghosts(self, node: RadixNode) -> bool:
        """Whether a ghost remembered the new node's first key (taken out
        of both; `_on_ghost_hit` hears of each)."""
        back = False
        for ghost in (0, 1):
            blocks = self._ghosts[ghost].pop(node.first_key, None)
            if blocks is not None:
                self._ghost_blocks[ghost] -= blocks
                back = True
                self._on_ghost_hit(ghost, blocks)
        return back

    def _on_ghost_hit(self, ghost: int, blocks: int) -> None:
        """A node comes back whose first key `ghost`'s ghost remembered."""

    def evicted_elsewhere(self, node: RadixNode) -> None:
        """The index is about to evict `node` (all or its tail) on another
        policy's choice (`auto`): remember it as a victim of its queue."""
        queue = self._state(node).queue
        self._leaving = node if queue in self.ghost_queues else None
        self._leaving_queue = queue

    # --- the index's hooks shared by both ---------------------------------

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        upper.policy_state = self._state(lower).copy()
        self._num_nodes += 1

    def on_remove(self, node: RadixNode) -> None:
        self._blocks[self._state(node).queue] -= len(node)
        self._num_nodes -= 1
        if node is self._leaving:
            self._leaving = None
            self._remember(node.first_key, len(node))

    def on_truncate(self, node: RadixNode, num_blocks: int) -> None:
        self._blocks[self._state(node).queue] -= num_blocks
        if node is self._leaving:  # the tail goes; the node keeps its first key
            self._leaving = None
            start = (len(node) - num_blocks) * KEY_BYTES
            self._remember(node.key_bytes[start : start + KEY_BYTES], num_blocks)

    # --- learning ----------------------------------------------------------

    def _remember(self, key: bytes, blocks: int) -> None:
        queue = self._leaving_queue
        ghost = self._ghosts[queue]
        self._ghost_blocks[queue] += blocks - ghost.get(key, 0)
        ghost[key] = blocks
        if self.ghost_blocks_share is None:
            limit = max(self._min_ghost, self._num_nodes)
            while len(ghost) > limit:
                self._ghost_blocks[queue] -= ghost.popitem(last=False)[1]
            return
        limit_blocks = self.ghost_blocks_share * (self._blocks[0] + self._blocks[1])
        while self._ghost_blocks[queue] > limit_blocks and ghost:
            self._ghost_blocks[queue] -= ghost.popitem(last=False)[1]

    def _adapt(self, ghost: int, blocks: int) -> None:
        """ARC's step: a return from queue 0's ghost grows its share, one
        from queue 1's shrinks it, within `SHARE_BOUNDS`. The step is the
        returning node's blocks as a share of the cached blocks (had that
        queue been larger by this node, the return would have been a hit),
        times the ratio of the other ghost's entries to this one's when it
        is above 1, so the rarer kind of return moves the share as much as
        the common kind in total."""
        total = max(self._blocks[0] + self._blocks[1], 1)
        this, other = len(self._ghosts[ghost]) + 1, len(self._ghosts[1 - ghost])
        step = blocks / total * max(1.0, other / this)
        share = self.share + (step if ghost == 0 else -step)
        self.share = min(max(share, SHARE_BOUNDS[0]), SHARE_BOUNDS[1])
