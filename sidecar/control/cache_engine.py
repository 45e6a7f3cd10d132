"""CacheEngine: one tier's index, slot pool and eviction thresholds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from contract.ids import BlockKeys, SlotIds
from sidecar.control.index import EvictedRun, InsertResult, MatchResult, RadixIndex
from sidecar.control.mempool import Mempool
from sidecar.control.node import RadixNode
from sidecar.control.policies import make_policy

EvictHook = Callable[[EvictedRun], np.ndarray]
"""Called with each run of blocks as it is evicted (its parent still in the
index); returns the slots it keeps (write-back in flight). The engine frees
the rest; the hook's owner frees what it kept."""


class CacheEngine:
    """One tier (CPU, SSD or remote): RadixIndex + Mempool + eviction policy.

    Eviction follows FlexKV's rule. It starts when utilisation is at least
    `evict_start_threshold`, or when fewer slots are free than asked for, and
    then evicts the largest of: what the request lacks, what brings
    utilisation back under the threshold, and `evict_ratio` x capacity.
    Namespaces over their quota (`set_quota`) are evicted first. A tier in
    an arena (`grow`) first takes free extents until the request fits under
    the threshold.
    """

    def __init__(
        self,
        name: str,
        num_slots: int,
        policy: str = "lru",
        evict_start_threshold: float = 0.95,
        evict_ratio: float = 0.01,
        hit_reward_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        record_events: bool = False,
    ) -> None:
        if not 0.0 < evict_start_threshold <= 1.0:
            raise ValueError(
                f"evict_start_threshold must be in (0, 1], got {evict_start_threshold}"
            )
        if not 0.0 <= evict_ratio <= 1.0:
            raise ValueError(f"evict_ratio must be in [0, 1], got {evict_ratio}")
        self.name = name
        self.index = RadixIndex(make_policy(policy, hit_reward_seconds), clock, record_events)
        self._observer = self.index.policy.observer
        self.mempool = Mempool(num_slots)
        self.evict_start_threshold = evict_start_threshold
        self.evict_ratio = evict_ratio
        self.evict_hook: EvictHook | None = None
        self.remove_hook: Callable[[np.ndarray], None] | None = None
        """Called with the slots `remove` frees (the SSD tier clears their
        journal records, so that a restart does not bring the blocks back)."""
        self.num_evicted_blocks = 0
        self.grow: Callable[[int, bool], int] | None = None
        """Set by the CPU tier's arena (`control.arena`) for a tier that shares
        it: `grow(n, steal)` asks for more slots before this tier evicts its
        own blocks; a free extent always, another geometry's extent when
        `steal` and its next victim is older than this tier's. Returns the
        slots granted."""
        self._quotas: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        return self.mempool.num_slots

    @property
    def utilisation(self) -> float:
        return self.mempool.num_used / self.capacity if self.capacity else 1.0

    def match(self, keys: BlockKeys, *, touch: bool = False) -> MatchResult:
        return self.index.match(keys, touch=touch)

    @property
    def observes(self) -> bool:
        """Whether the policy learns from requests (`auto`): then every
        lookup's whole key chain should reach `observe`."""
        return self._observer is not None

    def observe(self, keys: BlockKeys, *, defer: bool = False) -> None:
        """A request looked up in this tier: its whole key chain, misses
        included, told to a policy that learns from requests (nothing for
        the others). With `defer` it is queued for `observe_pending`, which
        the sidecar's loop runs between requests."""
        observer = self._observer
        if observer is not None:
            if defer:
                observer.submit(keys, self.capacity)
            else:
                observer.observe(keys, self.capacity)

    def observe_pending(self, deadline: float, stop: Callable[[], bool] | None = None) -> bool:
        """Work off deferred chains until `time.perf_counter()` passes
        `deadline` or `stop()` is true (a request waits); whether any are left."""
        return self._observer is not None and self._observer.work(deadline, stop)

    def policy_figures(self) -> dict[str, object]:
        figures: dict[str, object] = {"name": self.index.policy.name}
        if self._observer is not None:
            figures.update(self._observer.figures())
        return figures

    def allocate(self, n: int, ns: int = 0) -> SlotIds:
        """Up to n free slots for blocks of namespace `ns`, evicting as the
        thresholds say; fewer when the rest of the tier is locked, in flight
        or being written back. Lock what must survive (the prefix being
        extended) before calling.

        When `ns` has a quota, its own blocks are evicted first (in the
        policy's order) to make room under it, and no more is handed out
        than fits under it (possibly nothing)."""
        if self._quotas and n > 0 and ns in self._quotas:
            n = self._room_under_quota(n, ns, self._quotas[ns])
        if n <= 0 or (self.capacity == 0 and self.grow is None):
            return SlotIds(np.empty(0, dtype=np.int64))
        free, used = self.mempool.num_free, self.mempool.num_used
        threshold = self.evict_start_threshold * self.capacity
        grow = self.grow
        if (used >= threshold or free < n) and grow is not None:
            # Room from the arena before evicting our own blocks: free extents
            # until the n new blocks fit under the threshold (asking for n
            # alone left a tier at its threshold evicting its own blocks while
            # the arena had free extents); another geometry's extent only for
            # the n themselves.
            room = max(n, math.ceil((used + n) / self.evict_start_threshold) - used)
            grew = grow(room, False)
            if self.mempool.num_free < n:
                grew += grow(n, True)
            if grew:
                free, used = self.mempool.num_free, self.mempool.num_used
                threshold = self.evict_start_threshold * self.capacity
        if used >= threshold or free < n:
            want = max(
                n - free,
                used + n - math.floor(threshold),
                math.ceil(self.evict_ratio * self.capacity),
            )
            self._evict(want)
        return self.mempool.allocate(min(n, self.mempool.num_free))

    def evict(self, num_blocks: int) -> None:
        """Evict up to `num_blocks` blocks now, in the policy's order."""
        self._evict(num_blocks)

    def room_under_quota(self, n: int, ns: int) -> int:
        """How many of `n` new blocks namespace `ns` may add now (all of them
        without a quota), its own blocks evicted first to make room."""
        limit = self._quotas.get(ns)
        return n if limit is None else self._room_under_quota(n, ns, limit)

    def _room_under_quota(self, n: int, ns: int, limit: int) -> int:
        over = self.index.blocks_of(ns) + n - limit
        if over > 0:
            self._evict_from(over, ns)
        return max(0, min(n, limit - self.index.blocks_of(ns)))

    def _evict(self, num_blocks: int) -> None:
        """Evict num_blocks, from the namespaces over their quota first."""
        for ns, limit in self._quotas.items():
            over = self.index.blocks_of(ns) - limit
            if over > 0 and num_blocks > 0:
                num_blocks -= self._evict_from(min(over, num_blocks), ns)
        if num_blocks > 0:
            self._evict_from(num_blocks, None)

    def _evict_from(self, num_blocks: int, ns: int | None) -> int:
        hook = self.evict_hook
        kept: list[np.ndarray] = []
        if hook is None:
            result = self.index.evict(num_blocks, ns=ns)
        else:
            result = self.index.evict(num_blocks, lambda run: kept.append(hook(run)), ns=ns)
        if not result.runs:
            return 0
        self.num_evicted_blocks += result.num_blocks
        slots: np.ndarray = result.slots
        if kept:
            slots = np.setdiff1d(slots, np.concatenate(kept), assume_unique=True)
        self.mempool.free(slots)
        return result.num_blocks

    def insert(
        self, keys: BlockKeys, slots: SlotIds, *, ready: bool = False, ns: int = 0
    ) -> InsertResult:
        return self.index.insert(keys, slots, ready=ready, ns=ns)

    def set_ready(self, node: RadixNode) -> None:
        self.index.set_ready(node)

    def set_ready_front(self, node: RadixNode, keep: int) -> None:
        self.index.set_ready_front(node, keep)

    def discard(self, node: RadixNode) -> None:
        """Drop an unready node whose data never landed, and free its slots
        (held ones once released: Mempool.hold)."""
        self.mempool.free(self.index.discard(node))

    def remove(self, keys: BlockKeys) -> int:
        """Drop block keys[-1] and everything below it (see RadixIndex.remove);
        returns the number of blocks dropped."""
        return self._drop(self.index.remove(keys))

    def drop_from(self, node: RadixNode, pos: int) -> int:
        """Drop `node`'s blocks from `pos` on and every block below them
        (RadixIndex.remove_from), freeing their slots through `remove_hook`;
        returns the number of blocks dropped."""
        return self._drop(self.index.remove_from(node, pos))

    def _drop(self, slots: np.ndarray) -> int:
        """Free the slots of removed (not evicted) blocks, through `remove_hook`."""
        if self.remove_hook is not None and slots.size:
            self.remove_hook(slots)
        self.mempool.free(slots)
        return int(slots.size)

    # ---- namespaces -------------------------------------------------------------

    def set_quota(self, ns: int, max_blocks: int | None) -> None:
        """Hold namespace `ns` to at most `max_blocks` blocks in this tier
        (None: no quota). Evicts its own blocks down to a lower quota now;
        what is locked or in flight stays until a later allocation."""
        if max_blocks is None:
            self._quotas.pop(ns, None)
            return
        if max_blocks < 0:
            raise ValueError(f"a quota must be >= 0 blocks or None, got {max_blocks}")
        self._quotas[ns] = max_blocks
        over = self.index.blocks_of(ns) - max_blocks
        if over > 0:
            self._evict_from(over, ns)

    def quota(self, ns: int) -> int | None:
        return self._quotas.get(ns)

    def expire(self, now: float | None = None) -> int:
        """Drop the expired trees (RadixIndex.expire), through `remove_hook`;
        returns the blocks dropped."""
        return self._drop(self.index.expire(now))

    def clear_namespace(self, ns: int, keys_out: list[bytes] | None = None) -> tuple[int, int]:
        """Drop namespace `ns`'s blocks (RadixIndex.clear_namespace), through
        `remove_hook`; returns (blocks dropped, blocks kept: locked or in
        flight). The dropped keys' bytes are appended to `keys_out`."""
        slots, kept = self.index.clear_namespace(ns, keys_out)
        return self._drop(slots), kept

    def clear(self, keys_out: list[bytes] | None = None) -> tuple[int, int]:
        """Drop every ready, unlocked block, through `remove_hook` (nothing is
        written back); returns (blocks dropped, blocks kept). The dropped
        keys' bytes are appended to `keys_out`."""
        return self._drop(self.index.clear(keys_out)), self.index.num_blocks

    def free(self, slots: np.ndarray) -> None:
        self.mempool.free(slots)

    def lock(self, node: RadixNode) -> None:
        self.index.lock(node)

    def unlock(self, node: RadixNode) -> None:
        self.index.unlock(node)
