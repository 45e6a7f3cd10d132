"""The `auto` policy: its selector follows the candidate that does best on the
requests seen, and the real cache evicts in that candidate's order."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import FakeClock, assert_engine_clean, keys, make_engine, walk
from hypothesis import given
from hypothesis import strategies as st

from contract.ids import BlockKeys
from sidecar.control import shadows
from sidecar.control.auto import AutoPolicy
from sidecar.control.index import RadixIndex
from sidecar.control.policies import make_policy
from sidecar.control.shadows import Selector


class Tier:
    """A RadixIndex under `auto` driven as a tier handles a request: the
    selector sees it, the cached prefix is a hit, the rest is stored after
    evicting down to `capacity` blocks."""

    def __init__(self, names: tuple[str, ...], capacity: int) -> None:
        self.policy = AutoPolicy(Selector(names))
        self.clock = FakeClock()
        self.index = RadixIndex(self.policy, self.clock)
        self.capacity = capacity
        self.hits = 0
        self.next_slot = 0

    def request(self, req: BlockKeys, ns: int = 0) -> int:
        self.clock.set(self.clock.now + 1.0)
        self.policy.selector.observe(req, self.capacity)
        m = self.index.match(req, touch=True)
        new = len(req) - m.num_blocks
        if new:
            if m.node is not None:
                self.index.lock(m.node)
            over = self.index.num_blocks + new - self.capacity
            if over > 0:
                self.index.evict(over)
            slots = np.arange(self.next_slot, self.next_slot + new)
            self.next_slot += new
            self.index.insert(req, slots, ready=True, ns=ns)
            if m.node is not None:
                self.index.unlock(m.node)
        self.hits += m.num_blocks
        return m.num_blocks


def loop(tier: Tier, n: int, rounds: int, base: int = 0) -> None:
    """A cyclic scan over n one-block requests: LRU never hits, MRU keeps most."""
    for _ in range(rounds):
        for i in range(n):
            tier.request(keys(base + i + 1))


def recency(tier: Tier, steps: int, base: int) -> None:
    """Each step a new block, then the two before it: LRU hits both, MRU
    (which evicts the block just used) keeps missing."""
    for i in range(steps):
        for j in (i, i - 1, i - 2):
            if j >= 0:
                tier.request(keys(base + j))


def test_follows_the_candidate_that_wins_and_switches_back_when_the_workload_changes():
    tier = Tier(("lru", "mru"), capacity=50)
    loop(tier, 100, 12)
    assert tier.policy.chosen == "mru"
    # Under mru from the first check after the warm-up on, the real cache
    # hits about half of the scan, as the mru shadow does (lru: nothing).
    following = 1200 - shadows.WARMUP_REQUESTS - shadows.CHECK_EVERY
    assert tier.hits >= 0.4 * following
    recency(tier, 1500, base=10_000)
    assert tier.policy.chosen == "lru"
    assert tier.policy.selector.switches == 2
    assert tier.policy.selector.scores[0] > tier.policy.selector.scores[1]


def test_a_tie_never_switches():
    tier = Tier(("lru", "fifo"), capacity=20)
    for i in range(2000):  # every request new: both shadows hit nothing
        tier.request(keys(i + 1))
    assert tier.policy.chosen == "lru" and tier.policy.selector.switches == 0


def _check_candidates(index: RadixIndex) -> None:
    """Each candidate policy of each namespace holds exactly the evictable
    nodes, as the index does."""
    evictable = [n for n in walk(index.root) if n.parent is not None and n.evictable]
    policies = [space.policy for space in index._spaces.values()]
    assert all(isinstance(p, AutoPolicy) for p in policies)
    assert index.num_candidates == len(evictable)
    for i, name in enumerate(policies[0].selector.names):
        held = sum(p.members[i].num_candidates for p in policies)  # type: ignore[attr-defined]
        assert held == len(evictable), name
    for node in walk(index.root):
        if node.parent is None:
            continue
        assert (node.heap_token is not None) == node.evictable
        for view in AutoPolicy.views(node):
            assert view.real is node
            assert (view.heap_token is not None) == node.evictable


@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(0, 3)),
        min_size=1,
        max_size=120,
    ),
    st.integers(0, 3),
)
def test_every_candidate_keeps_exactly_the_real_candidates(requests, switch_every):
    """Random requests of prefixes, switching the followed candidate as it
    goes: candidates are conserved and every victim is an evictable node."""
    tier = Tier(("lru", "s3fifo", "lfu", "arc"), capacity=12)
    popped: list[bool] = []
    pop = tier.policy.pop

    def checked_pop():
        node = pop()
        popped.append(node is None or node.evictable)
        return node

    tier.policy.pop = checked_pop  # type: ignore[method-assign]
    for step, (tree, length, turn) in enumerate(requests):
        if switch_every and step % switch_every == 0:
            tier.policy.selector.chosen = step % len(tier.policy.members)
        req = keys(*[tree * 1000 + turn * (d > 2) * 100 + d for d in range(length)])
        tier.request(req)
        _check_candidates(tier.index)
        assert tier.index.num_blocks <= tier.capacity
    assert all(popped)
    tier.index.evict(tier.index.num_blocks)
    assert tier.index.num_blocks == 0 and tier.policy.num_candidates == 0
    _check_candidates(tier.index)


def test_evicts_in_the_chosen_candidates_order():
    index = RadixIndex(AutoPolicy(Selector(("lru", "lfu"))), FakeClock())
    for i in range(1, 4):
        index.insert(keys(i), np.array([i]), ready=True)
    index.match(keys(1), touch=True)
    index.match(keys(1), touch=True)
    index.match(keys(2), touch=True)
    policy = index.policy
    assert isinstance(policy, AutoPolicy)
    policy.selector.chosen = 1  # lfu: 3 (no hits) first, then 2, then 1
    assert [r.slots.tolist() for r in index.evict(2).runs] == [[3], [2]]
    policy.selector.chosen = 0  # lru from here on: only 1 is left
    assert index.evict(5).slots.tolist() == [1]


def test_namespaces_share_one_selector_and_evict_across():
    tier = Tier(("lru", "mru"), capacity=40)
    for i in range(30):
        tier.request(keys(i + 1, high=1 + i % 3), ns=1 + i % 3)
    spaces = [tier.index._spaces[ns].policy for ns in (1, 2, 3)]
    assert all(isinstance(p, AutoPolicy) and p.selector is tier.policy.selector for p in spaces)
    assert tier.index.blocks_of(2) == 10
    assert tier.index.evict(4, ns=2).num_blocks == 4
    assert tier.index.blocks_of(2) == 6
    # Across namespaces under lru: the four oldest left (ns 2's 2, 5, 8, 11 went).
    evicted = tier.index.evict(4).runs
    assert sorted(int(np.frombuffer(r.key_bytes, np.uint64)[0]) for r in evicted) == [1, 3, 4, 6]
    _check_candidates(tier.index)


def test_the_cache_engine_tells_auto_of_observed_lookups_only():
    engine = make_engine("cpu", 16, "auto")
    policy = engine.index.policy
    assert isinstance(policy, AutoPolicy) and engine.observes
    engine.match(keys(1, 2), touch=True)  # a load: the lookup's sequel, not a request
    assert policy.selector.observed == 0
    engine.observe(keys(1, 2))
    assert policy.selector.observed == 1
    for name in ("lru", "s3fifo", "arc"):
        assert make_policy(name).observer is None
        plain = make_engine("cpu", 16, name)
        assert not plain.observes
        plain.observe(keys(1, 2))  # nothing to tell
        assert not plain.observe_pending(time.perf_counter() + 1)


def test_deferred_chains_wait_for_work_and_a_full_queue_drops_new_ones(monkeypatch):
    monkeypatch.setattr(shadows, "MAX_PENDING", 3)
    engine = make_engine("cpu", 16, "auto")
    selector = engine.index.policy.selector
    for i in range(5):
        engine.observe(keys(1, i + 10), defer=True)
    assert (selector.observed, selector.pending, selector.dropped) == (0, 3, 2)
    assert not engine.observe_pending(time.perf_counter() + 60)
    assert (selector.observed, selector.pending) == (3, 0)
    # A deadline already past still makes one step per call (a chain taken
    # from the queue, then one shadow's turn at it): work always moves.
    for i in range(3):
        engine.observe(keys(2, i + 10), defer=True)
    assert engine.observe_pending(time.perf_counter() - 1)
    assert (selector.observed, selector.pending) == (3, 3)  # one under way, two queued
    for _ in range(len(selector.names)):
        assert engine.observe_pending(time.perf_counter() - 1)
    assert (selector.observed, selector.pending) == (4, 2)
    figures = engine.policy_figures()
    assert figures == {
        "name": "auto",
        "following": selector.chosen_name,
        "switches": 0,
        "observed": 4,
        "observed_blocks": 8,
        "pending": 2,
        "dropped": 2,
    }
    assert make_engine("cpu", 16, "lru").policy_figures() == {"name": "lru"}


@given(
    st.lists(st.lists(st.integers(1, 12), min_size=0, max_size=6), max_size=40),
    st.integers(1, 7),
)
def test_work_stopped_between_shadows_ends_as_whole_chains_observed(requests, every):
    """`work` stops for a waiting request after any shadow's step; the
    chains it stops part way go on later, and the shadows end exactly as if
    each chain had been observed whole, in order."""
    whole, paced = Selector(shadows.CANDIDATES), Selector(shadows.CANDIDATES)
    capacity = 6
    for ids in requests:
        req = keys(*ids) if ids else BlockKeys(np.empty(0, dtype=keys(1).dtype))
        whole.observe(req, capacity)
        paced.submit(req, capacity)
    calls, steps = 0, [0]

    def stop() -> bool:  # a request arrives after every `every` steps
        steps[0] += 1
        return steps[0] % every == 0

    while paced.work(time.perf_counter() + 60, stop):
        calls += 1
        assert calls < 10_000
    assert paced.pending == 0
    assert (paced.observed, paced.observed_blocks) == (whole.observed, whole.observed_blocks)
    assert paced.scores == whole.scores and paced.lookups == whole.lookups
    assert paced.chosen == whole.chosen
    for a, b in zip(paced._shadows, whole._shadows, strict=True):
        assert sorted(n.key_bytes for n in walk(a.root)) == sorted(
            n.key_bytes for n in walk(b.root)
        )


def test_a_stop_leaves_the_rest_of_the_chain_for_the_next_call():
    selector = Selector(shadows.CANDIDATES)
    selector.submit(keys(1, 2, 3), 16)
    assert selector.work(time.perf_counter() + 60, stop=lambda: True)  # took the chain
    assert selector.work(time.perf_counter() + 60, stop=lambda: True)  # first shadow
    assert (selector.observed, selector.pending) == (0, 1)
    assert [s.num_blocks for s in selector._shadows] == [3] + [0] * (len(selector.names) - 1)
    assert not selector.work(time.perf_counter() + 60)
    assert (selector.observed, selector.pending) == (1, 0)


def test_a_big_tier_is_simulated_on_a_sample_of_its_requests(monkeypatch):
    monkeypatch.setattr(shadows, "FULL_SHADOW_BLOCKS", 1000)
    monkeypatch.setattr(shadows, "SAMPLE_DEPTH", 2)
    selector = Selector(("lru",))
    for i in range(4000):  # one shared first key, as a system prompt
        selector.observe(keys(1, i + 100_000), capacity=4000)
    assert selector.rate == pytest.approx(0.25)
    assert 800 <= selector.observed <= 1200
    # Sampled by the key at SAMPLE_DEPTH: a sampled request's continuations
    # are sampled too, the others' are not.
    seen = selector.observed
    for i in range(4000):
        selector.observe(keys(1, i + 100_000, i + 200_000), capacity=4000)
    assert selector.observed - seen == seen


def test_the_sampling_rate_follows_the_tiers_capacity(monkeypatch):
    """A tier in an arena grows and shrinks: the rate is set from its
    capacity as it is now, so the shadows stay bounded."""
    monkeypatch.setattr(shadows, "FULL_SHADOW_BLOCKS", 1000)
    selector = Selector(("lru",))
    selector.observe(keys(1, 2), capacity=500)
    assert selector.rate == 1.0
    selector.observe(keys(1, 3), capacity=8000)
    assert selector.rate == pytest.approx(0.125)
    selector.observe(keys(1, 4), capacity=800)
    assert selector.rate == 1.0


def test_a_selector_needs_a_candidate():
    with pytest.raises(ValueError, match="at least one candidate"):
        Selector(())


def test_a_cache_engine_under_auto_follows_the_winner_through_its_lookups(monkeypatch):
    """End to end through the hook: `CacheEngine.observe` feeds the
    selector, and the tier's own hits follow the candidate it picks."""
    monkeypatch.setattr(shadows, "CANDIDATES", ("lru", "mru"))
    engine = make_engine("cpu", 50, "auto")
    policy = engine.index.policy
    assert isinstance(policy, AutoPolicy) and policy.selector.names == ("lru", "mru")
    hits = []
    for _ in range(12):
        for i in range(100):  # a cyclic scan twice the tier's size
            req = keys(i + 1)
            engine.observe(req)
            m = engine.match(req, touch=True)
            hits.append(m.num_blocks)
            if not m.num_blocks:
                slots = engine.allocate(1)
                assert slots.size == 1
                engine.insert(req, slots, ready=True)
    assert policy.chosen == "mru"
    assert sum(hits[:100]) == 0  # the first pass finds nothing
    assert sum(hits[-300:]) >= 0.3 * 300  # under mru, about half of the scan hits
    assert_engine_clean(engine)
