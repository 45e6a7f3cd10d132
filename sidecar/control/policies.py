"""Eviction policies: which unlocked, ready leaf of a radix index goes first.

A policy holds the *candidate set*: the nodes that are evictable right now
(ready, unlocked, no children). The index keeps it current through `add` and
`discard` as nodes change, so choosing a victim never scans or sorts the
tree: every policy here costs O(log n) per evicted node.

Names and semantics follow FlexKV, so its configs carry over:

| name            | evicts first                                          |
|-----------------|-------------------------------------------------------|
| lru             | least recently used (+ `hit_reward_seconds`)          |
| lfu             | fewest hits, ties by least recently used              |
| fifo            | oldest inserted                                       |
| mru             | most recently used                                    |
| filo            | newest inserted                                       |
| s3fifo          | S3-FIFO: small / main FIFO queues with a ghost        |
| s3fifo_adaptive | S3-FIFO, the small queue's share learned from ghosts  |
| s3fifo_blocks   | S3-FIFO, its ghost bounded in blocks (as the paper's) |
| arc             | ARC; its frequent queue by aged own-hit counts        |
| auto            | whichever of its five candidates does best lately     |
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from contract.ids import BlockKeys
from sidecar.control.node import RadixNode

next_token: Callable[[], int]
"""A `node.heap_token` no candidate heap in this process has handed out.
One counter for every heap: a node moved to another heap (a namespace's
takeover, S3-FIFO's split) leaves a stale entry in the old one, which a
token that heap could also hand out would bring back to life."""
try:
    from sidecar.control._nodeheap import next_token
except ImportError:  # the C heaps take theirs from the same counter
    next_token = itertools.count(1).__next__


class RequestObserver(Protocol):
    """What a policy that learns from whole requests (`auto`) is told."""

    def observe(self, keys: BlockKeys, capacity: int) -> None:
        """A request's whole key chain, looked up in a tier of `capacity`
        blocks (`CacheEngine.observe`)."""

    def submit(self, keys: BlockKeys, capacity: int) -> None:
        """`observe`, queued until `work` runs."""

    def work(self, deadline: float, stop: Callable[[], bool] | None = None) -> bool:
        """Observe queued requests until `time.perf_counter()` passes
        `deadline` or `stop()` is true; whether any are left."""

    def figures(self) -> dict[str, object]:
        """What it follows and how much it has seen, for the stats."""


class EvictionPolicy(ABC):
    """Contract between a `RadixIndex` and a policy.

    The index calls, as things happen:
    - `on_insert(node)` when a node is created (ready or not);
    - `on_hit(node)` after it updated a node's access stats on a match;
    - `on_split(upper, lower)` when a node is cut in two (`upper` is the new
      parent; `lower` keeps its identity and candidacy);
    - `on_remove(node)` when a node leaves the index for good;
    - `on_truncate(node, n)` when the last n blocks of a node are evicted
      (called while the node still holds them);
    - `add(node)` when a node becomes evictable, or is evictable and its
      stats changed; `discard(node)` when it stops being evictable.
    `pop()` removes and returns the next victim among the candidates, or
    None when there are none. The index then evicts all or part of it.
    `peek()` returns the node `pop()` would look at first, changing nothing
    the index can see, and `peek_key()` its place in the eviction order:
    keys of two policies of one kind compare (lowest goes first), so an
    index holding one policy per namespace (`spawn()`: a fresh, empty
    policy of the same kind and settings) evicts across them in one order.
    """

    name: str = ""
    observer: RequestObserver | None = None
    """Set by a policy that must see whole requests; its tier's
    `CacheEngine.observe` then passes every lookup's key chain to it."""

    def on_insert(self, node: RadixNode) -> None:  # noqa: B027 - optional hook
        pass

    def on_hit(self, node: RadixNode) -> None:  # noqa: B027 - optional hook
        pass

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:  # noqa: B027
        pass

    def on_remove(self, node: RadixNode) -> None:  # noqa: B027 - optional hook
        pass

    def on_truncate(self, node: RadixNode, num_blocks: int) -> None:  # noqa: B027
        pass

    @abstractmethod
    def add(self, node: RadixNode) -> None: ...

    @abstractmethod
    def discard(self, node: RadixNode) -> None: ...

    @abstractmethod
    def pop(self) -> RadixNode | None: ...

    @abstractmethod
    def peek(self) -> RadixNode | None: ...

    @abstractmethod
    def peek_key(self) -> tuple[float, float, int] | None: ...

    @abstractmethod
    def spawn(self) -> EvictionPolicy: ...

    @property
    @abstractmethod
    def num_candidates(self) -> int: ...


class LazyHeap:
    """A min-heap of nodes by key (k0, k1, k2), with O(1) removal by invalidation.

    A node's live entry is the one whose sequence number equals
    `node.heap_token`; older entries are skipped when popped. When stale
    entries outnumber live ones the heap is rebuilt, so its size stays
    O(candidates) and every operation stays amortised O(log n). Equal keys
    pop in push order.

    This is the pure-Python reference; `NodeHeap` (from the optional C
    extension `sidecar.control._nodeheap`, same contract) keeps the entries in one
    contiguous array, which keeps a pop cheap when the heap outgrows the CPU
    caches.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, float, int, int, RadixNode]] = []
        self.size = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: RadixNode, k0: float, k1: float, k2: int) -> None:
        if node.heap_token is None:
            self.size += 1
        token = node.heap_token = next_token()
        heapq.heappush(self._heap, (k0, k1, k2, token, node))
        if len(self._heap) > 2 * self.size + 1024:
            self._heap = [e for e in self._heap if e[4].heap_token == e[3]]
            heapq.heapify(self._heap)

    def remove(self, node: RadixNode) -> None:
        if node.heap_token is not None:
            node.heap_token = None
            self.size -= 1

    def pop(self) -> RadixNode | None:
        heap = self._heap
        while heap:
            _, _, _, seq, node = heapq.heappop(heap)
            if node.heap_token == seq:
                node.heap_token = None
                self.size -= 1
                return node
        return None

    def peek(self) -> RadixNode | None:
        """The node `pop` would return, left in place (stale entries on top are dropped)."""
        heap = self._heap
        while heap:
            top = heap[0]
            if top[4].heap_token == top[3]:
                return top[4]
            heapq.heappop(heap)
        return None


class CandidateHeap(Protocol):
    """What a policy needs of its candidate heap: LazyHeap or the C NodeHeap."""

    @property
    def size(self) -> int: ...
    def push(self, node: RadixNode, k0: float, k1: float, k2: int, /) -> None: ...
    def remove(self, node: RadixNode, /) -> None: ...
    def pop(self) -> RadixNode | None: ...
    def peek(self) -> RadixNode | None: ...


NodeHeap: type[CandidateHeap]
try:
    from sidecar.control._nodeheap import NodeHeap
except ImportError:  # the C extension is optional; the reference is exact, only slower
    NodeHeap = LazyHeap

Priority = Callable[[RadixNode], tuple[float, float, int]]


class PriorityPolicy(EvictionPolicy):
    """A policy that is a fixed ordering of candidates: lowest `priority` goes first."""

    def __init__(self, priority: Priority, name: str) -> None:
        self._priority = priority
        self._heap = NodeHeap()
        self.name = name

    def add(self, node: RadixNode) -> None:
        self._heap.push(node, *self._priority(node))

    def discard(self, node: RadixNode) -> None:
        self._heap.remove(node)

    def pop(self) -> RadixNode | None:
        return self._heap.pop()

    def peek(self) -> RadixNode | None:
        return self._heap.peek()

    def peek_key(self) -> tuple[float, float, int] | None:
        node = self._heap.peek()
        return None if node is None else self._priority(node)

    def spawn(self) -> PriorityPolicy:
        return PriorityPolicy(self._priority, self.name)

    @property
    def num_candidates(self) -> int:
        return self._heap.size


def _lru(reward: float) -> Priority:
    if reward == 0.0:
        return lambda n: (n.last_access, 0.0, n.access_seq)
    # Each hit moves the node `reward` seconds later in effective time.
    return lambda n: (n.last_access + reward * n.hit_count, 0.0, n.access_seq)


# Each ordering is a key (k0, k1, k2): floats, floats, int; lowest goes first.
_ORDERINGS: dict[str, Callable[[float], Priority]] = {
    "lru": _lru,
    "lfu": lambda _: lambda n: (n.hit_count, n.last_access, n.access_seq),
    "fifo": lambda _: lambda n: (0.0, 0.0, n.birth),
    "mru": lambda _: lambda n: (-n.last_access, 0.0, -n.access_seq),
    "filo": lambda _: lambda n: (0.0, 0.0, -n.birth),
}

POLICY_NAMES: tuple[str, ...] = (
    *_ORDERINGS,
    "s3fifo",
    "s3fifo_adaptive",
    "s3fifo_blocks",
    "arc",
    "auto",
)
DEFAULT_POLICY = "auto"
"""The default of the `eviction_policy` setting (see docs/control-plane.md for why)."""


def make_policy(name: str, hit_reward_seconds: float = 0.0) -> EvictionPolicy:
    """The policy registered as `name`; `hit_reward_seconds` applies to lru
    only (not to `auto`'s lru candidate)."""
    if hit_reward_seconds < 0:
        raise ValueError(f"hit_reward_seconds must be >= 0, got {hit_reward_seconds}")
    if name == "s3fifo":
        from sidecar.control.s3fifo import S3FifoPolicy

        return S3FifoPolicy()
    if name == "s3fifo_adaptive":
        from sidecar.control.s3fifo import AdaptiveS3FifoPolicy

        return AdaptiveS3FifoPolicy()
    if name == "s3fifo_blocks":
        from sidecar.control.s3fifo import S3FifoBlocksPolicy

        return S3FifoBlocksPolicy()
    if name == "arc":
        from sidecar.control.arc import ArcPolicy

        return ArcPolicy()
    if name == "auto":
        from sidecar.control.auto import AutoPolicy

        return AutoPolicy()
    if name not in _ORDERINGS:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
    return PriorityPolicy(_ORDERINGS[name](float(hit_reward_seconds)), name)
