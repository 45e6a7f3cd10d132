"""S3-FIFO over radix-index nodes (Yang et al., SOSP '23), adapted to prefix trees.

Nodes enter a small FIFO (S) unless their first key is remembered by the
ghost queue G, in which case they enter the main FIFO (M). Eviction takes
from S while S holds more than 10% of the cached blocks, else from M:
- the oldest candidate of S moves to M if it was hit since insertion,
  otherwise it is evicted and remembered in G;
- the oldest candidate of M is reinserted at M's tail with its hit count
  decremented while the count is positive, otherwise evicted.
Only candidates (evictable leaves) are considered, so a parent is visited
once its children are gone. Each node is moved at most once from S to M and
reinserted at most `MAX_FREQ` times per hit, so a victim costs amortised
O(log n).

`peek()` is an approximation: the head of the queue `pop` would look at
first, which `pop` may yet move to M instead of evicting. Its `peek_key()`
is that node's (last access, 0, access seq), so policies of several
namespaces compare by the age of their heads, as memcached balances slabs.

`AdaptiveS3FifoPolicy` (`s3fifo_adaptive`) learns S's share instead of fixing
it at 10%, the way ARC learns its split: a second ghost remembers what M
evicted; a key coming back from S's ghost says S was too small (the node was
evicted before its second use), one coming back from M's ghost says M was.
See `AdaptiveS3FifoPolicy` for the step sizes.
"""

from __future__ import annotations

from sidecar.control.node import RadixNode
from sidecar.control.policies import NodeHeap
from sidecar.control.two_queues import TwoQueues

SMALL, MAIN = 0, 1
MAX_FREQ = 3
SMALL_SHARE = 0.1


class _State:
    __slots__ = ("freq", "qseq", "queue", "returned")

    def __init__(self, queue: int, qseq: int) -> None:
        self.queue = queue
        self.freq = 0
        self.qseq = qseq
        self.returned = False
        """In M because its first key came back from the ghost, and not hit
        since (`s3fifo_blocks` only)."""

    def copy(self) -> _State:
        other = _State(self.queue, self.qseq)
        other.freq = self.freq
        other.returned = self.returned
        return other


class S3FifoPolicy(TwoQueues):
    name = "s3fifo"
    ghost_queues: tuple[int, ...] = (SMALL,)

    def __init__(self, min_ghost_entries: int = 1024) -> None:
        super().__init__(min_ghost_entries, SMALL_SHARE)
        self._heaps = (NodeHeap(), NodeHeap())
        self._seq = 0

    @property
    def small_share(self) -> float:
        """S is evicted from while it holds more than this share of the blocks."""
        return self.share

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @staticmethod
    def _state(node: RadixNode) -> _State:
        state = node.policy_state
        assert isinstance(state, _State)
        return state

    def on_insert(self, node: RadixNode) -> None:
        queue = MAIN if self._back_from_ghosts(node) else SMALL
        node.policy_state = _State(queue, self._next_seq())
        self._blocks[queue] += len(node)
        self._num_nodes += 1

    def on_hit(self, node: RadixNode) -> None:
        state = self._state(node)
        state.freq = min(state.freq + 1, MAX_FREQ)

    def add(self, node: RadixNode) -> None:
        state = self._state(node)
        self._heaps[state.queue].push(node, 0.0, 0.0, state.qseq)

    def discard(self, node: RadixNode) -> None:
        if node.heap_token is not None:
            self._heaps[self._state(node).queue].remove(node)

    @property
    def num_candidates(self) -> int:
        return self._heaps[SMALL].size + self._heaps[MAIN].size

    def spawn(self) -> S3FifoPolicy:
        return type(self)(self._min_ghost)

    def _next_queue(self) -> int:
        total = self._blocks[SMALL] + self._blocks[MAIN]
        small_first = self._blocks[SMALL] > self.share * total
        queue = SMALL if small_first and self._heaps[SMALL].size else MAIN
        return queue if self._heaps[queue].size else SMALL

    def peek(self) -> RadixNode | None:
        if not self.num_candidates:
            return None
        return self._heaps[self._next_queue()].peek()

    def peek_key(self) -> tuple[float, float, int] | None:
        node = self.peek()
        return None if node is None else (node.last_access, 0.0, node.access_seq)

    def pop(self) -> RadixNode | None:
        while self.num_candidates:
            queue = self._next_queue()
            node = self._heaps[queue].pop()
            assert node is not None
            state = self._state(node)
            if state.freq == 0:
                self._leaving = node if queue in self.ghost_queues else None
                self._leaving_queue = queue
                return node
            if queue == SMALL:
                self._blocks[SMALL] -= len(node)
                self._blocks[MAIN] += len(node)
                state.queue, state.freq = MAIN, 0
            else:
                state.freq -= 1
            state.qseq = self._next_seq()
            self._heaps[MAIN].push(node, 0.0, 0.0, state.qseq)
        return None


class AdaptiveS3FifoPolicy(S3FifoPolicy):
    """S3-FIFO whose small-queue share is learned from ghost hits.

    Both queues' victims are remembered. A node returning from S's ghost
    grows `small_share`, one returning from M's ghost shrinks it, by ARC's
    step (`TwoQueues._adapt`). Both ghosts are bounded like S3-FIFO's one,
    so this costs O(1) per eviction on top of the heaps' O(log n).
    """

    name = "s3fifo_adaptive"
    ghost_queues = (SMALL, MAIN)

    def _on_ghost_hit(self, ghost: int, blocks: int) -> None:
        self._adapt(ghost, blocks)


GHOST_BLOCKS_SHARE = 0.9


class S3FifoBlocksPolicy(S3FifoPolicy):
    """S3-FIFO with the paper's ghost and without a returning node's tail in M.

    The ghost is bounded by the blocks it remembers, 90% of the cached
    blocks (the paper bounds it by M's size in objects), not by the number
    of cached nodes (at least 1,024), which over big nodes remembers many
    times the cache and lets every returning node into M. A node that
    enters M because its first key came back from the ghost brings the new
    request's tail with it; when a later match splits off that tail before
    it was used, the tail goes back to S (a per-block S3-FIFO would have
    put only the returning blocks in M).
    """

    name = "s3fifo_blocks"
    ghost_blocks_share = GHOST_BLOCKS_SHARE

    def on_insert(self, node: RadixNode) -> None:
        super().on_insert(node)
        state = self._state(node)
        state.returned = state.queue == MAIN

    def on_hit(self, node: RadixNode) -> None:
        super().on_hit(node)
        self._state(node).returned = False

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        super().on_split(upper, lower)
        state = self._state(lower)
        if state.returned and state.queue == MAIN:
            candidate = lower.heap_token is not None
            if candidate:
                self.discard(lower)
            self._blocks[MAIN] -= len(lower)
            self._blocks[SMALL] += len(lower)
            state.queue, state.freq, state.returned = SMALL, 0, False
            state.qseq = self._next_seq()
            if candidate:
                self.add(lower)
