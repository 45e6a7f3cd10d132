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

from collections import OrderedDict

from contract.ids import KEY_BYTES
from sidecar.control.node import RadixNode
from sidecar.control.policies import EvictionPolicy, NodeHeap

SMALL, MAIN = 0, 1
MAX_FREQ = 3
SMALL_SHARE = 0.1
SHARE_BOUNDS = (0.01, 0.9)
"""Where the adaptive policy keeps S's share: S never vanishes (new nodes
always have a probation queue) and M always keeps a tenth of the blocks."""


class _State:
    __slots__ = ("freq", "qseq", "queue")

    def __init__(self, queue: int, qseq: int) -> None:
        self.queue = queue
        self.freq = 0
        self.qseq = qseq

    def copy(self) -> _State:
        other = _State(self.queue, self.qseq)
        other.freq = self.freq
        return other


class S3FifoPolicy(EvictionPolicy):
    name = "s3fifo"
    ghost_queues: tuple[int, ...] = (SMALL,)
    """The queues whose victims a ghost remembers."""

    def __init__(self, min_ghost_entries: int = 1024) -> None:
        self._heaps = (NodeHeap(), NodeHeap())
        self._blocks = [0, 0]
        self._seq = 0
        self._ghosts: tuple[OrderedDict[bytes, int], OrderedDict[bytes, int]] = (
            OrderedDict(),
            OrderedDict(),
        )
        """First keys of what S (and, when remembered, M) evicted -> blocks evicted."""
        self._min_ghost = min_ghost_entries
        self._num_nodes = 0
        self.small_share = SMALL_SHARE
        """S is evicted from while it holds more than this share of the blocks."""
        self._leaving: RadixNode | None = None
        """The victim `pop` just gave from a queue in `ghost_queues`: a ghost
        remembers the first key of what the index then evicts of it (all of
        it, or a tail)."""
        self._leaving_queue = SMALL

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @staticmethod
    def _state(node: RadixNode) -> _State:
        state = node.policy_state
        assert isinstance(state, _State)
        return state

    def on_insert(self, node: RadixNode) -> None:
        key = node.first_key
        queue = SMALL
        for ghost in (SMALL, MAIN):
            blocks = self._ghosts[ghost].pop(key, None)
            if blocks is not None:
                queue = MAIN
                self._on_ghost_hit(ghost, blocks)
        node.policy_state = _State(queue, self._next_seq())
        self._blocks[queue] += len(node)
        self._num_nodes += 1

    def _on_ghost_hit(self, ghost: int, blocks: int) -> None:
        """A node comes back whose first key `ghost`'s ghost remembered."""

    def on_hit(self, node: RadixNode) -> None:
        state = self._state(node)
        state.freq = min(state.freq + 1, MAX_FREQ)

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

    def add(self, node: RadixNode) -> None:
        state = self._state(node)
        self._heaps[state.queue].push(node, 0.0, 0.0, state.qseq)

    def discard(self, node: RadixNode) -> None:
        if node.heap_token is not None:
            self._heaps[self._state(node).queue].remove(node)

    @property
    def num_candidates(self) -> int:
        return self._heaps[SMALL].size + self._heaps[MAIN].size

    @property
    def queue_blocks(self) -> tuple[int, int]:
        """Blocks of the nodes in S and in M (candidates or not)."""
        return self._blocks[SMALL], self._blocks[MAIN]

    def spawn(self) -> S3FifoPolicy:
        return type(self)(self._min_ghost)

    def _next_queue(self) -> int:
        total = self._blocks[SMALL] + self._blocks[MAIN]
        small_first = self._blocks[SMALL] > self.small_share * total
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

    def _remember(self, key: bytes, blocks: int) -> None:
        ghost = self._ghosts[self._leaving_queue]
        ghost[key] = blocks
        limit = max(self._min_ghost, self._num_nodes)
        while len(ghost) > limit:
            ghost.popitem(last=False)


class AdaptiveS3FifoPolicy(S3FifoPolicy):
    """S3-FIFO whose small-queue share is learned from ghost hits.

    Both queues' victims are remembered. A node returning from S's ghost
    grows `small_share`, one returning from M's ghost shrinks it, within
    `SHARE_BOUNDS`. The step is ARC's: the returning node's blocks as a share
    of the cached blocks (had that queue been larger by this node, the
    return would have been a hit), times the ratio of the other ghost's
    entries to this one's when it is above 1, so the rarer kind of ghost hit
    moves the share as much as the common kind in total. Both ghosts are
    bounded like S3-FIFO's one, so this costs O(1) per eviction on top of
    the heaps' O(log n).
    """

    name = "s3fifo_adaptive"
    ghost_queues = (SMALL, MAIN)

    def _on_ghost_hit(self, ghost: int, blocks: int) -> None:
        total = max(self._blocks[SMALL] + self._blocks[MAIN], 1)
        this, other = len(self._ghosts[ghost]) + 1, len(self._ghosts[1 - ghost])
        step = blocks / total * max(1.0, other / this)
        share = self.small_share + (step if ghost == SMALL else -step)
        self.small_share = min(max(share, SHARE_BOUNDS[0]), SHARE_BOUNDS[1])
