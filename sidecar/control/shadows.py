"""The `auto` policy's selector: which candidate the real cache follows.

Each candidate policy runs in a shadow: a `RadixIndex` of its own holding
keys only (every slot 0), fed the requests the tier sees (`observe`, called
by `CacheEngine.match` on a lookup that counts a hit) exactly as the tier
handles them: the leading run of cached blocks is a hit and is touched, the
rest is inserted, evicting in the candidate's order down to the shadow's
capacity. Each shadow's hits decay with a half-life of `HALF_LIFE_REQUESTS`
observed requests; the chosen candidate changes only when another one's
decayed hits exceed its own by `SWITCH_MARGIN` of the decayed lookups
(0.5 hit-ratio points: a relative margin is too wide at high hit ratios and
too narrow at low ones), checked every `CHECK_EVERY` requests after the
first `WARMUP_REQUESTS` (empty shadows say little, and a policy whose order
is built from counts, lfu, loses what it would have kept if it is left
early), so switching is rare and a tie never flips it.

Miniature simulation (SHARDS, Waldspurger et al., ATC '17): a tier larger
than `FULL_SHADOW_BLOCKS` blocks is simulated on a sample of its requests,
at rate R = FULL_SHADOW_BLOCKS / capacity, each shadow holding R x capacity
blocks. A request is observed when a hash of its key at depth
`SAMPLE_DEPTH` (its last key if shorter) falls under R, so requests that
share their first SAMPLE_DEPTH blocks are sampled together: a conversation
past that depth is sampled whole. Not the first key: every request of the Mooncake trace,
and of the rag and sessions shapes, starts with one shared system prompt,
so sampling by the first key takes all or nothing. Below that size there is
no sampling (R = 1): a gap of a point needs thousands of observed requests
to show. The shadows' cost is thus bounded: at most FULL_SHADOW_BLOCKS
blocks of keys per candidate, and R index operations per candidate per
request.

What it is fed: every lookup's whole key chain, misses included, once
(`CacheEngine.observe`): the sidecar's Lookup handler gives it; engines
that look up in their own mapping of the hot index hash the rest of the
prompt past the first miss on a thread of their own and send the chains in
their Touch batches (engine_shim/hotpath.py). A load or a save is not a
request: it is the lookup's sequel. In the sidecar the chains wait in a
queue (`submit`) that the loop works off between requests (`work`), so no
request waits for a shadow; a queue longer than `MAX_PENDING` drops new
chains (counted), which only makes the sample smaller. The constants were
chosen by a sweep over the committed traces.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from contract.ids import SLOT_DTYPE, BlockKeys, SlotIds
from sidecar.control.index import RadixIndex
from sidecar.control.policies import make_policy

CANDIDATES: tuple[str, ...] = ("s3fifo_blocks", "arc", "lru", "s3fifo", "lfu")
"""Followed candidates, the first being the initial choice; each wins
somewhere in `bench replay` (docs/control-plane.md)."""
HALF_LIFE_REQUESTS = 2000
WARMUP_REQUESTS = 500
SWITCH_MARGIN = 0.005
CHECK_EVERY = 50
FULL_SHADOW_BLOCKS = 1 << 20
SAMPLE_DEPTH = 128
MAX_PENDING = 4096
"""Chains queued for the shadows at most; later ones are dropped."""

_HASH_RANGE = 1 << 32


def _sample_hash(keys: BlockKeys) -> int:
    """32 well-mixed bits of the key at depth SAMPLE_DEPTH (Fibonacci
    hashing: trace keys may be small integers)."""
    depth = min(SAMPLE_DEPTH, keys.size)
    low = int.from_bytes(keys[depth - 1 : depth].tobytes()[:8], "little")
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
        self.lookups = 0.0
        """Blocks looked up, decayed as the scores are."""
        self.switches = 0
        self.observed = 0
        """Requests the shadows simulated (sampled ones only)..."""
        self.observed_blocks = 0
        """... and their blocks."""
        self.dropped = 0
        """Chains dropped because the queue was full."""
        self._pending: deque[tuple[BlockKeys, int]] = deque()
        self._current: tuple[BlockKeys, int] | None = None
        """The chain `work` is part way through (its keys and the shadows'
        capacity for it), and `_next` the shadow it goes on with."""
        self._next = 0
        self.rate = 1.0
        self._shadows: list[RadixIndex] = []
        self._tier_capacity = -1
        self._threshold = _HASH_RANGE
        self._decay = 0.5 ** (1.0 / HALF_LIFE_REQUESTS)
        self._zeros = SlotIds(np.zeros(0, dtype=SLOT_DTYPE))

    @property
    def chosen_name(self) -> str:
        return self.names[self.chosen]

    @property
    def pending(self) -> int:
        return len(self._pending) + (self._current is not None)

    def submit(self, keys: BlockKeys, capacity: int) -> None:
        """`observe` later, when `work` runs (a full queue drops it)."""
        if len(self._pending) < MAX_PENDING:
            self._pending.append((keys, capacity))
        else:
            self.dropped += 1

    def work(self, deadline: float, stop: Callable[[], bool] | None = None) -> bool:
        """Observe queued chains, oldest first, one shadow at a time, until
        none is left, `time.perf_counter()` passes `deadline` or `stop()`
        says so (both checked after each shadow's step: a request that
        arrives waits for one step, ~5-20 us for a 2,048-key chain, not
        for a whole chain); whether any is left. A chain stopped part way
        goes on with its next shadow at the next call."""
        pending = self._pending
        while self._current is not None or pending:
            if self._current is None:
                keys, capacity = pending.popleft()
                shadow_capacity = self._begin(keys, capacity)
                if shadow_capacity is not None:  # else not in the sample: done
                    self._current, self._next = (keys, shadow_capacity), 0
            else:
                keys, shadow_capacity = self._current
                self._step(keys, self._next, shadow_capacity)
                self._next += 1
                if self._next == len(self._shadows):
                    self._current = None
                    self._end(keys)
            if time.perf_counter() >= deadline or (stop is not None and stop()):
                break
        return bool(pending) or self._current is not None

    def figures(self) -> dict[str, object]:
        return {
            "following": self.chosen_name,
            "switches": self.switches,
            "observed": self.observed,
            "observed_blocks": self.observed_blocks,
            "pending": self.pending,
            "dropped": self.dropped,
        }

    def observe(self, keys: BlockKeys, capacity: int) -> None:
        """A request's keys, looked up in a tier of `capacity` blocks: on
        every shadow now."""
        shadow_capacity = self._begin(keys, capacity)
        if shadow_capacity is not None:
            for i in range(len(self._shadows)):
                self._step(keys, i, shadow_capacity)
            self._end(keys)

    def _begin(self, keys: BlockKeys, capacity: int) -> int | None:
        """Sample a chain: the shadows' capacity for it, None if it is not
        observed (empty, or outside the sample)."""
        if not self._shadows:
            self._start()
        if capacity != self._tier_capacity:  # a tier in an arena grows and shrinks
            self._tier_capacity = capacity
            self.rate = min(1.0, FULL_SHADOW_BLOCKS / max(capacity, 1))
            self._threshold = int(self.rate * _HASH_RANGE)
        if keys.size == 0:
            return None
        if self.rate < 1.0 and _sample_hash(keys) >= self._threshold:
            return None
        self.lookups = self.lookups * self._decay + keys.size
        return max(1, round(self.rate * capacity))

    def _step(self, keys: BlockKeys, i: int, shadow_capacity: int) -> None:
        """The chain on shadow `i`: its decayed score and its hits."""
        hits = self._access(self._shadows[i], keys, shadow_capacity)
        self.scores[i] = self.scores[i] * self._decay + hits

    def _end(self, keys: BlockKeys) -> None:
        """Every shadow has seen the chain: counted, and now and then a decision."""
        self.observed += 1
        self.observed_blocks += keys.size
        if self.observed >= WARMUP_REQUESTS and self.observed % CHECK_EVERY == 0:
            self._decide()

    def _start(self) -> None:
        counter = [0.0]

        def clock() -> float:
            counter[0] += 1.0
            return counter[0]

        self._shadows = [RadixIndex(make_policy(n), clock) for n in self.names]

    def _access(self, shadow: RadixIndex, keys: BlockKeys, capacity: int) -> int:
        """One request on one shadow of `capacity` blocks (rate x the
        tier's): its hit blocks."""
        m = shadow.match(keys, touch=True)
        hits = m.num_blocks
        new = min(keys.size - hits, capacity)
        if new <= 0:
            return hits
        if m.node is not None:
            shadow.lock(m.node)  # the prefix being extended stays
        over = shadow.num_blocks + new - capacity
        if over > 0:
            shadow.evict(over)
        new = min(new, capacity - shadow.num_blocks)
        if new > 0:
            if self._zeros.size < new:
                self._zeros = SlotIds(np.zeros(2 * new, dtype=SLOT_DTYPE))
            shadow.insert(BlockKeys(keys[: hits + new]), SlotIds(self._zeros[:new]), ready=True)
        if m.node is not None:
            shadow.unlock(m.node)
        return hits

    def _decide(self) -> None:
        scores = self.scores
        best = max(range(len(scores)), key=scores.__getitem__)
        lead = scores[best] - scores[self.chosen]
        if best != self.chosen and lead > SWITCH_MARGIN * self.lookups:
            self.chosen = best
            self.switches += 1
