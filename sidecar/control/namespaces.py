"""Namespace: one namespace's share of a RadixIndex.

Every block carries a small integer namespace id (0: none or unknown, e.g.
blocks recovered from disk). Keys are salted by namespace, so a tree hanging
from one child of the root belongs to one namespace. For each namespace the
index keeps:

- its block count, moved on every insert, split, eviction and removal;
- its own eviction policy instance (`EvictionPolicy.spawn`), so evicting
  only this namespace pops its candidates without looking at the others';
- while it has a TTL, a heap of its trees (children of the root) by birth.
  `born` never decreases down a path, so a tree's oldest node is its top:
  when the top is expired the whole tree is, and nothing else need be
  queued. A split of a top queues the new top; entries whose node is no
  longer a top of this namespace are skipped when they come up.
"""

from __future__ import annotations

import heapq
import itertools

from sidecar.control.node import RadixNode
from sidecar.control.policies import EvictionPolicy

ExpiryEntry = tuple[float, int, RadixNode]


class Namespace:
    __slots__ = ("_order", "blocks", "expiry", "ns", "policy", "ttl")

    def __init__(self, ns: int, policy: EvictionPolicy) -> None:
        self.ns = ns
        self.policy = policy
        self.blocks = 0
        self.ttl: float | None = None
        self.expiry: list[ExpiryEntry] | None = None
        """Trees by birth while `ttl` is set; None otherwise (nothing queued)."""
        self._order = itertools.count()

    def set_ttl(self, seconds: float | None, tops: list[RadixNode]) -> None:
        """Serve and keep blocks at most `seconds` after their birth (None:
        forever). `tops` are this namespace's trees, queued when a TTL starts."""
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a TTL must be > 0 seconds or None, got {seconds}")
        if seconds is None:
            self.ttl, self.expiry = None, None
            return
        if self.expiry is None:
            self.expiry = [(top.born, next(self._order), top) for top in tops]
            heapq.heapify(self.expiry)
        self.ttl = float(seconds)

    def track(self, top: RadixNode) -> None:
        """`top` became a tree of this namespace (new, the upper half of a
        split, or claimed): queue it if the namespace has a TTL."""
        if self.expiry is not None:
            heapq.heappush(self.expiry, (top.born, next(self._order), top))

    def due(self, now: float) -> list[ExpiryEntry]:
        """Pop the queued entries born more than `ttl` seconds before `now`."""
        if self.expiry is None or self.ttl is None:
            return []
        cutoff = now - self.ttl
        out = []
        while self.expiry and self.expiry[0][0] < cutoff:
            out.append(heapq.heappop(self.expiry))
        return out

    def requeue(self, entry: ExpiryEntry) -> None:
        """Put back an entry `due` gave whose tree could not go yet (locked, in flight)."""
        if self.expiry is not None:
            heapq.heappush(self.expiry, entry)

    def expired(self, node: RadixNode, now: float) -> bool:
        return self.ttl is not None and node.born < now - self.ttl
