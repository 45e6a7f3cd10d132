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
"""

from __future__ import annotations

from collections import OrderedDict

from contract.ids import KEY_BYTES
from sidecar.control.node import RadixNode
from sidecar.control.policies import EvictionPolicy, NodeHeap

SMALL, MAIN = 0, 1
MAX_FREQ = 3
SMALL_SHARE = 0.1


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

    def __init__(self, min_ghost_entries: int = 1024) -> None:
        self._heaps = (NodeHeap(), NodeHeap())
        self._blocks = [0, 0]
        self._seq = 0
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._min_ghost = min_ghost_entries
        self._num_nodes = 0
        self._leaving: RadixNode | None = None
        """The victim `pop` just gave from S: the ghost remembers the first key
        of what the index then evicts of it (all of it, or a tail)."""

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
        queue = MAIN if key in self._ghost else SMALL
        self._ghost.pop(key, None)
        node.policy_state = _State(queue, self._next_seq())
        self._blocks[queue] += len(node)
        self._num_nodes += 1

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
            self._remember(node.first_key)

    def on_truncate(self, node: RadixNode, num_blocks: int) -> None:
        self._blocks[self._state(node).queue] -= num_blocks
        if node is self._leaving:  # the tail goes; the node keeps its first key
            self._leaving = None
            start = (len(node) - num_blocks) * KEY_BYTES
            self._remember(node.key_bytes[start : start + KEY_BYTES])

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
        return S3FifoPolicy(self._min_ghost)

    def _next_queue(self) -> int:
        total = self._blocks[SMALL] + self._blocks[MAIN]
        small_first = self._blocks[SMALL] > SMALL_SHARE * total
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
                self._leaving = node if queue == SMALL else None
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

    def _remember(self, key: bytes) -> None:
        self._ghost[key] = None
        limit = max(self._min_ghost, self._num_nodes)
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)
