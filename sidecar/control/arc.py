"""ARC over radix-index nodes, its frequent queue ordered by aged frequency.

Nodes enter the recent queue T1 (ordered by least recent use). A hit moves a
node to the frequent queue T2, and so does coming back while a ghost
remembers it. Eviction takes from T1 while T1 holds more than
`recent_share` of the cached blocks, else from T2. ARC's adaptation sets the
share: a node coming back from T1's ghost grows it, one from T2's ghost
shrinks it (`TwoQueues._adapt`, within `SHARE_BOUNDS`).

T2 evicts the node with the fewest *own* hits first (hits that ended a match
at this node, so an ancestor of a long conversation is not made hot by every
turn below it), ties by least recent use. The counts age as TinyLFU's do:
after `AGING_HITS_PER_NODE` own hits per cached node, every count is
halved, so what was popular long ago does not stay forever (plain LFU keeps
finished conversations and evicts the live ones' new turns). Halving is
lazy: a node's count is brought up to date when it is next read, and the
T2 heap is rebuilt with the new counts, O(candidates) once per
O(nodes) hits.

The candidates sit in two lazy min-heaps (T1, T2) that share a token per
node (`node.heap_token`), so moving a node between queues or dropping it
invalidates its old entry; heaps are rebuilt when stale entries outnumber
live ones, so each operation costs amortised O(log n). Both ghosts are
bounded by the number of cached nodes (at least `min_ghost_entries`).
`peek_key()` is the head's (last access, 0, access seq), comparable across
namespaces like S3-FIFO's.
"""

from __future__ import annotations

import heapq

from sidecar.control.node import RadixNode
from sidecar.control.policies import next_token
from sidecar.control.two_queues import TwoQueues

RECENT, FREQUENT = 0, 1
RECENT_SHARE = 0.1
"""The recent queue's share of the blocks before any ghost hit (S3-FIFO's)."""
AGING_HITS_PER_NODE = 0.5
"""Own hits per cached node (at least `MIN_AGING_HITS`) between two halvings."""
MIN_AGING_HITS = 64

_Entry = tuple[float, float, int, int, RadixNode]


class _State:
    __slots__ = ("candidate_queue", "epoch", "freq", "queue")

    def __init__(self, queue: int, freq: int, epoch: int) -> None:
        self.queue = queue
        self.freq = freq
        """Own hits, halved once per aging epoch since `epoch`."""
        self.epoch = epoch
        self.candidate_queue = queue
        """The queue whose candidate count holds the node while it is a candidate."""

    def copy(self) -> _State:
        return _State(self.queue, self.freq, self.epoch)


class ArcPolicy(TwoQueues):
    name = "arc"

    def __init__(self, min_ghost_entries: int = 1024) -> None:
        super().__init__(min_ghost_entries, RECENT_SHARE)
        self._heaps: tuple[list[_Entry], list[_Entry]] = ([], [])
        """T1 by recency, T2 by (aged own hits, recency)."""
        self._candidates = [0, 0]
        self._last_touch = -1
        self.epoch = 0
        """Aging epochs so far: each halved every own-hit count."""
        self._hits_this_epoch = 0

    @property
    def recent_share(self) -> float:
        """T1 is evicted from while it holds more than this share of the blocks."""
        return self.share

    @staticmethod
    def _state(node: RadixNode) -> _State:
        state = node.policy_state
        assert isinstance(state, _State)
        return state

    def freq(self, node: RadixNode) -> int:
        """`node`'s own hits, aged to now."""
        state = self._state(node)
        self._age(state)
        return state.freq

    # --- the index's hooks -------------------------------------------------

    def on_insert(self, node: RadixNode) -> None:
        back = self._back_from_ghosts(node)
        queue, freq = (FREQUENT, 1) if back else (RECENT, 0)  # coming back is a use
        node.policy_state = _State(queue, freq, self.epoch)
        self._blocks[queue] += len(node)
        self._num_nodes += 1

    def on_hit(self, node: RadixNode) -> None:
        state = self._state(node)
        if node.access_seq != self._last_touch:  # the deepest node of this match
            self._last_touch = node.access_seq
            self._age(state)
            state.freq += 1
            self._hits_this_epoch += 1
            if self._hits_this_epoch >= max(MIN_AGING_HITS, AGING_HITS_PER_NODE * self._num_nodes):
                self._next_epoch()
        if state.queue == RECENT:
            # A candidate stays one: the index adds it again, and `add` moves it to T2.
            self._blocks[RECENT] -= len(node)
            self._blocks[FREQUENT] += len(node)
            state.queue = FREQUENT

    def add(self, node: RadixNode) -> None:
        state = self._state(node)
        if node.heap_token is None:
            self._candidates[state.queue] += 1
        elif state.candidate_queue != state.queue:
            self._candidates[state.candidate_queue] -= 1
            self._candidates[state.queue] += 1
        state.candidate_queue = state.queue
        node.heap_token = next_token()
        heapq.heappush(self._heaps[state.queue], self._entry(node, state))
        if len(self._heaps[0]) + len(self._heaps[1]) > 2 * self.num_candidates + 1024:
            for heap in self._heaps:
                heap[:] = [e for e in heap if e[4].heap_token == e[3]]
                heapq.heapify(heap)

    def _entry(self, node: RadixNode, state: _State) -> _Entry:
        token = node.heap_token
        assert token is not None
        if state.queue == RECENT:
            return (node.last_access, 0.0, node.access_seq, token, node)
        self._age(state)
        return (float(state.freq), node.last_access, node.access_seq, token, node)

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

    def _on_ghost_hit(self, ghost: int, blocks: int) -> None:
        self._adapt(ghost, blocks)

    def spawn(self) -> ArcPolicy:
        return ArcPolicy(self._min_ghost)

    def _top(self, queue: int) -> RadixNode | None:
        heap = self._heaps[queue]
        while heap:
            entry = heap[0]
            if entry[4].heap_token == entry[3]:
                return entry[4]
            heapq.heappop(heap)
        return None

    def _next_queue(self) -> int:
        total = self._blocks[RECENT] + self._blocks[FREQUENT]
        recent_first = self._blocks[RECENT] > self.share * total
        queue = RECENT if recent_first and self._candidates[RECENT] else FREQUENT
        return queue if self._candidates[queue] else RECENT

    def peek(self) -> RadixNode | None:
        return self._top(self._next_queue()) if self.num_candidates else None

    def peek_key(self) -> tuple[float, float, int] | None:
        node = self.peek()
        return None if node is None else (node.last_access, 0.0, node.access_seq)

    def pop(self) -> RadixNode | None:
        if not self.num_candidates:
            return None
        queue = self._next_queue()
        node = self._top(queue)
        assert node is not None
        self.discard(node)
        self._leaving, self._leaving_queue = node, queue
        return node

    # --- learning ----------------------------------------------------------

    def _age(self, state: _State) -> None:
        if state.epoch != self.epoch:
            state.freq >>= min(self.epoch - state.epoch, 63)
            state.epoch = self.epoch

    def _next_epoch(self) -> None:
        """Halve every count: T2's candidates get entries with their new counts."""
        self.epoch += 1
        self._hits_this_epoch = 0
        live = [e[4] for e in self._heaps[FREQUENT] if e[4].heap_token == e[3]]
        self._heaps[FREQUENT][:] = [self._entry(n, self._state(n)) for n in live]
        heapq.heapify(self._heaps[FREQUENT])
