"""The `auto` policy's selector: which candidate the real cache follows.

Each candidate policy runs in a shadow: a `RadixIndex` of its own holding
keys only (every slot 0), fed the requests the tier sees (`observe`, called
by `CacheEngine.match` on a lookup that counts a hit) exactly as the tier
handles them: the leading run of cached blocks is a hit and is touched, the
rest is inserted, evicting in the candidate's order down to the shadow's
capacity. Each shadow's hits decay with a half-life of `HALF_LIFE_REQUESTS`
observed requests; the chosen candidate changes only when another one's
decayed hits exceed its own by `SWITCH_MARGIN` (relative), checked every
`CHECK_EVERY` requests after the first `WARMUP_REQUESTS` (empty shadows
say little, and a policy whose order is built from counts, lfu, loses
what it would have kept if it is left early), so switching is rare and a
tie never flips it.

Miniature simulation (SHARDS, Waldspurger et al., ATC '17): a tier larger
than `FULL_SHADOW_BLOCKS` blocks is simulated on a sample of its trees
only, at rate R = FULL_SHADOW_BLOCKS / capacity: a request is observed when
a hash of its first key falls under R, and each shadow holds R x capacity
blocks. Sampling by the first key keeps whole trees, so a sampled request
finds its sampled prefix. Below that size there is no sampling (R = 1): a
hit ratio gap of a point needs thousands of observed requests to show, and
trees sharing one system prompt (one first key) would be sampled all or
nothing. A shadow's cost is thus bounded by FULL_SHADOW_BLOCKS blocks of
keys per candidate.
"""

from __future__ import annotations

import numpy as np

from contract.ids import SLOT_DTYPE, BlockKeys, SlotIds
from sidecar.control.index import RadixIndex
from sidecar.control.policies import make_policy

CANDIDATES: tuple[str, ...] = ("arc", "lru", "s3fifo", "lfu")
"""Followed candidates, the first being the initial choice; each wins
somewhere in `bench replay` (docs/control-plane.md)."""
HALF_LIFE_REQUESTS = 500
WARMUP_REQUESTS = 500
SWITCH_MARGIN = 0.01
CHECK_EVERY = 50
MIN_DWELL_REQUESTS = 0
FULL_SHADOW_BLOCKS = 1 << 20

_HASH_RANGE = 1 << 32


def _tree_hash(keys: BlockKeys) -> int:
    """32 well-mixed bits of the first key (Fibonacci hashing: trace keys
    may be small integers)."""
    low = int.from_bytes(keys[:1].tobytes()[:8], "little")
    return ((low * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32


class Selector:
    """Scores every candidate on observed requests and names the one to follow.

    One selector serves every namespace of a tier (`AutoPolicy.spawn` shares
    it): one decision over the whole tier, and the namespaces' victim keys
    stay comparable.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        if not names:
            raise ValueError("the auto policy needs at least one candidate")
        self.names = names
        self.chosen = 0
        """Index in `names` of the candidate the real cache follows."""
        self.scores = [0.0] * len(names)
        """Each shadow's hit blocks, decayed per observed request."""
        self.switches = 0
        self.observed = 0
        self._last_switch = 0
        self.rate = 1.0
        self._shadows: list[RadixIndex] = []
        self._capacity = 0
        self._threshold = _HASH_RANGE
        self._decay = 0.5 ** (1.0 / HALF_LIFE_REQUESTS)
        self._zeros = SlotIds(np.zeros(0, dtype=SLOT_DTYPE))

    @property
    def chosen_name(self) -> str:
        return self.names[self.chosen]

    def observe(self, keys: BlockKeys, capacity: int) -> None:
        """A request's keys, looked up in a tier of `capacity` blocks."""
        if not self._shadows:
            self._start(capacity)
        if keys.size == 0:
            return
        if self.rate < 1.0 and _tree_hash(keys) >= self._threshold:
            return
        self._capacity = max(1, round(self.rate * capacity))
        decay = self._decay
        scores = self.scores
        for i, shadow in enumerate(self._shadows):
            scores[i] = scores[i] * decay + self._access(shadow, keys)
        self.observed += 1
        if self.observed >= WARMUP_REQUESTS and self.observed % CHECK_EVERY == 0:
            self._decide()

    def _start(self, capacity: int) -> None:
        self.rate = min(1.0, FULL_SHADOW_BLOCKS / max(capacity, 1))
        self._threshold = int(self.rate * _HASH_RANGE)
        counter = [0.0]

        def clock() -> float:
            counter[0] += 1.0
            return counter[0]

        self._shadows = [RadixIndex(make_policy(n), clock) for n in self.names]

    def _access(self, shadow: RadixIndex, keys: BlockKeys) -> int:
        """One request on one shadow: its hit blocks."""
        m = shadow.match(keys, touch=True)
        hits = m.num_blocks
        new = min(keys.size - hits, self._capacity)
        if new <= 0:
            return hits
        if m.node is not None:
            shadow.lock(m.node)  # the prefix being extended stays
        over = shadow.num_blocks + new - self._capacity
        if over > 0:
            shadow.evict(over)
        new = min(new, self._capacity - shadow.num_blocks)
        if new > 0:
            if self._zeros.size < new:
                self._zeros = SlotIds(np.zeros(2 * new, dtype=SLOT_DTYPE))
            shadow.insert(BlockKeys(keys[: hits + new]), SlotIds(self._zeros[:new]), ready=True)
        if m.node is not None:
            shadow.unlock(m.node)
        return hits

    def _decide(self) -> None:
        best = max(range(len(self.scores)), key=self.scores.__getitem__)
        if self.observed - self._last_switch < MIN_DWELL_REQUESTS:
            return
        scores = self.scores
        if best != self.chosen and scores[best] > (1 + SWITCH_MARGIN) * scores[self.chosen]:
            self.chosen = best
            self._last_switch = self.observed
            self.switches += 1
