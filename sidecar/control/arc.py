"""ARC over radix-index nodes, its frequent queue ordered by LRU or LFU, learned.

Nodes enter the recent queue T1 (ordered by least recent use). A hit moves a
node to the frequent queue T2, and so does coming back while a ghost
remembers it. Eviction takes from T1 while T1 holds more than
`recent_share` of the cached blocks, else from T2. ARC's adaptation sets the
share: a node coming back from T1's ghost grows it, one from T2's ghost
shrinks it (the step is `AdaptiveS3FifoPolicy`'s, within `SHARE_BOUNDS`).

T2 has two orders, and eviction follows the one that has lost fewer hits
lately:
- LRU: least recently used first;
- LFU: fewest *own* hits first (hits that ended a match at this node, so an
  ancestor of a long conversation is not made hot by every turn below it),
  then least recently used.
At each T2 eviction the order not followed names its own victim, which stays
cached and is marked *spared*. A hit on a spared node is a hit that order
would have lost; a node coming back from T2's ghost is one the followed
order lost. Each counts against its order, with exponential decay
(`LOSS_DECAY` per loss), so the cache follows the recent winner. The spared
marks and both ghosts are bounded by the number of cached nodes (at least
`min_ghost_entries`).

Candidates sit in lazy min-heaps (T1, T2 by LRU, T2 by LFU) that share one
token per node (`node.heap_token`): discarding a candidate invalidates all its
entries at once, and heaps are rebuilt when stale entries outnumber live
ones, so each operation costs amortised O(log n). `peek_key()` is the head's
(last access, 0, access seq), comparable across namespaces like S3-FIFO's.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from contract.ids import KEY_BYTES
from sidecar.control.node import RadixNode
from sidecar.control.policies import EvictionPolicy
from sidecar.control.s3fifo import SHARE_BOUNDS

RECENT, FREQUENT = 0, 1
LRU, LFU = 0, 1
RECENT_SHARE = 0.1
"""The recent queue's share of the blocks before any ghost hit (S3-FIFO's)."""
LOSS_DECAY = 0.999
"""Each lost hit multiplies both orders' loss counts by this before counting."""

_Entry = tuple[float, float, int, int, RadixNode]


class _State:
    __slots__ = ("candidate_queue", "freq", "queue")

    def __init__(self, queue: int, freq: int) -> None:
        self.queue = queue
        self.freq = freq
        self.candidate_queue = queue
        """The queue whose candidate count holds the node while it is a candidate."""

    def copy(self) -> _State:
        return _State(self.queue, self.freq)


class ArcPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, min_ghost_entries: int = 1024) -> None:
        self._heaps: tuple[list[_Entry], list[_Entry], list[_Entry]] = ([], [], [])
        """T1 by LRU, T2 by LRU, T2 by LFU."""
        self._candidates = [0, 0]
        self._blocks = [0, 0]
        self._token = 0
        self._num_nodes = 0
        self._min_ghost = min_ghost_entries
        self._ghosts: tuple[OrderedDict[bytes, tuple[int, int]], ...] = (
            OrderedDict(),
            OrderedDict(),
        )
        """First keys of what each queue evicted -> (blocks, the T2 order that evicted it)."""
        self._spared: OrderedDict[int, tuple[RadixNode, int]] = OrderedDict()
        """id(node) -> (node, the T2 order that would have evicted it)."""
        self._last_touch = -1
        self._leaving: RadixNode | None = None
        self._leaving_queue = RECENT
        self.recent_share = RECENT_SHARE
        self.losses = [0.0, 0.0]
        """Decayed hits lost by T2's LRU and LFU orders."""
        self.order = LRU
        """The T2 order eviction follows now."""

    @staticmethod
    def _state(node: RadixNode) -> _State:
        state = node.policy_state
        assert isinstance(state, _State)
        return state

    # --- the index's hooks -------------------------------------------------

    def on_insert(self, node: RadixNode) -> None:
        queue, freq = RECENT, 0
        for ghost in (RECENT, FREQUENT):
            found = self._ghosts[ghost].pop(node.first_key, None)
            if found is not None:
                queue, freq = FREQUENT, 1  # coming back is a use
                blocks, order = found
                self._adapt(ghost, blocks)
                if ghost == FREQUENT:
                    self._lose(order)
        node.policy_state = _State(queue, freq)
        self._blocks[queue] += len(node)
        self._num_nodes += 1

    def on_hit(self, node: RadixNode) -> None:
        state = self._state(node)
        if node.access_seq != self._last_touch:  # the deepest node of this match
            self._last_touch = node.access_seq
            state.freq += 1
        spared = self._spared.pop(id(node), None)
        if spared is not None and spared[0] is node:
            self._lose(spared[1])
        if state.queue == RECENT:
            # A candidate stays one: the index adds it again, and `add` moves it to T2.
            self._blocks[RECENT] -= len(node)
            self._blocks[FREQUENT] += len(node)
            state.queue = FREQUENT

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        upper.policy_state = self._state(lower).copy()
        self._num_nodes += 1

    def on_remove(self, node: RadixNode) -> None:
        self._blocks[self._state(node).queue] -= len(node)
        self._num_nodes -= 1
        self._spared.pop(id(node), None)
        if node is self._leaving:
            self._leaving = None
            self._remember(node.first_key, len(node))

    def on_truncate(self, node: RadixNode, num_blocks: int) -> None:
        self._blocks[self._state(node).queue] -= num_blocks
        if node is self._leaving:  # the tail goes; the node keeps its first key
            self._leaving = None
            start = (len(node) - num_blocks) * KEY_BYTES
            self._remember(node.key_bytes[start : start + KEY_BYTES], num_blocks)

    def add(self, node: RadixNode) -> None:
        state = self._state(node)
        if node.heap_token is None:
            self._candidates[state.queue] += 1
        elif state.candidate_queue != state.queue:
            self._candidates[state.candidate_queue] -= 1
            self._candidates[state.queue] += 1
        state.candidate_queue = state.queue
        self._token += 1
        token = node.heap_token = self._token
        if state.queue == RECENT:
            heapq.heappush(self._heaps[0], (node.last_access, 0.0, node.access_seq, token, node))
        else:
            heapq.heappush(self._heaps[1], (node.last_access, 0.0, node.access_seq, token, node))
            heapq.heappush(
                self._heaps[2], (float(state.freq), node.last_access, node.access_seq, token, node)
            )
        live = self._candidates[RECENT] + self._candidates[FREQUENT]
        if sum(len(h) for h in self._heaps) > 2 * live + 1024:
            for heap in self._heaps:
                heap[:] = [e for e in heap if e[4].heap_token == e[3]]
                heapq.heapify(heap)

    def discard(self, node: RadixNode) -> None:
        if node.heap_token is not None:
            node.heap_token = None
            self._candidates[self._state(node).candidate_queue] -= 1

    # --- choosing victims --------------------------------------------------

    @property
    def num_candidates(self) -> int:
        return self._candidates[RECENT] + self._candidates[FREQUENT]

    @property
    def queue_candidates(self) -> tuple[int, int]:
        """Candidates in T1 and in T2."""
        return self._candidates[RECENT], self._candidates[FREQUENT]

    @property
    def queue_blocks(self) -> tuple[int, int]:
        """Blocks of the nodes in T1 and in T2 (candidates or not)."""
        return self._blocks[RECENT], self._blocks[FREQUENT]

    def spawn(self) -> ArcPolicy:
        return ArcPolicy(self._min_ghost)

    def _top(self, heap: list[_Entry]) -> RadixNode | None:
        while heap:
            entry = heap[0]
            if entry[4].heap_token == entry[3]:
                return entry[4]
            heapq.heappop(heap)
        return None

    def _next_queue(self) -> int:
        total = self._blocks[RECENT] + self._blocks[FREQUENT]
        recent_first = self._blocks[RECENT] > self.recent_share * total
        queue = RECENT if recent_first and self._candidates[RECENT] else FREQUENT
        return queue if self._candidates[queue] else RECENT

    def peek(self) -> RadixNode | None:
        if not self.num_candidates:
            return None
        if self._next_queue() == RECENT:
            return self._top(self._heaps[0])
        return self._top(self._heaps[1 + self.order])

    def peek_key(self) -> tuple[float, float, int] | None:
        node = self.peek()
        return None if node is None else (node.last_access, 0.0, node.access_seq)

    def pop(self) -> RadixNode | None:
        if not self.num_candidates:
            return None
        queue = self._next_queue()
        if queue == RECENT:
            node = self._top(self._heaps[0])
        else:
            node = self._top(self._heaps[1 + self.order])
            other = self._top(self._heaps[2 - self.order])
            if other is not None and other is not node:
                self._spared[id(other)] = (other, 1 - self.order)
                self._bound(self._spared)
        assert node is not None
        self.discard(node)
        self._leaving, self._leaving_queue = node, queue
        return node

    # --- learning ----------------------------------------------------------

    def _remember(self, key: bytes, blocks: int) -> None:
        ghost = self._ghosts[self._leaving_queue]
        ghost[key] = (blocks, self.order)
        self._bound(ghost)

    def _bound(self, table: OrderedDict) -> None:
        limit = max(self._min_ghost, self._num_nodes)
        while len(table) > limit:
            table.popitem(last=False)

    def _adapt(self, ghost: int, blocks: int) -> None:
        """ARC's step: a return from T1's ghost grows T1's share, from T2's shrinks it."""
        total = max(self._blocks[RECENT] + self._blocks[FREQUENT], 1)
        this, other = len(self._ghosts[ghost]) + 1, len(self._ghosts[1 - ghost])
        step = blocks / total * max(1.0, other / this)
        share = self.recent_share + (step if ghost == RECENT else -step)
        self.recent_share = min(max(share, SHARE_BOUNDS[0]), SHARE_BOUNDS[1])

    def _lose(self, order: int) -> None:
        """A hit that T2's `order` lost (or would have)."""
        self.losses = [loss * LOSS_DECAY for loss in self.losses]
        self.losses[order] += 1.0
        self.order = LRU if self.losses[LRU] <= self.losses[LFU] else LFU
