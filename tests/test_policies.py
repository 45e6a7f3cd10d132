"""Eviction policies, driven through a RadixIndex with a fake clock."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from helpers import FakeClock, chain, key_ids, keys, make_index

from sidecar.control.policies import POLICY_NAMES, make_policy
from sidecar.control.s3fifo import MAIN, SMALL
from sidecar.control.shadows import CANDIDATES

LEAVES = "ABCDE"


def one_block_leaves(policy: str, hits: list[tuple[float, str]], **kwargs):
    """Leaves A..E (ids 1..5) inserted at t=0..4, then matched at the given times."""
    clock = FakeClock()
    index = make_index(policy, clock, **kwargs)
    for i in range(len(LEAVES)):
        clock.set(float(i))
        index.insert(keys(i + 1), np.array([i]), ready=True)
    for t, name in hits:
        clock.set(t)
        assert index.match(keys(LEAVES.index(name) + 1), touch=True).num_blocks == 1
    return index


def eviction_order(index) -> str:
    """Evict one block at a time until nothing is left; the leaf names in victim order."""
    return eviction_order_n(index, index.num_blocks + 1)


def eviction_order_n(index, limit: int) -> str:
    """Evict one block at a time, at most `limit` times; the leaf names in victim order."""
    order = []
    for _ in range(limit):
        result = index.evict(1)
        if result.num_blocks == 0:
            break
        assert result.num_blocks == 1 and len(result.runs) == 1
        order.extend(LEAVES[i - 1] for i in key_ids(result.runs[0].key_bytes))
    return "".join(order)


# After the hits: A last=13 hits=1, B last=12 hits=2, C last=2 hits=0,
# D last=11 hits=1, E last=4 hits=0; inserted in order A..E.
HITS = [(10.0, "B"), (11.0, "D"), (12.0, "B"), (13.0, "A")]
TRUTH = {
    "lru": "CEDBA",
    "lfu": "CEDAB",  # hit count first, then least recent
    "fifo": "ABCDE",  # insertion order, hits do not matter
    "mru": "ABDEC",
    "filo": "EDCBA",
    # S: A B C D E. A and B were hit: they move to M. C is evicted; D hit:
    # moves to M; E evicted; then M in order A, B, D.
    "s3fifo": "CEABD",
    "s3fifo_adaptive": "CEABD",  # no ghost hits yet: the share is still 10%
    "s3fifo_blocks": "CEABD",  # no ghost hits yet: as s3fifo
    # T1 (never hit): C, E by recency; then T2 (A, B, D: hit) by own hits,
    # then recency, as lfu.
    "arc": "CEDAB",
}
# Before it has seen a request, auto follows its first candidate.
TRUTH["auto"] = TRUTH[CANDIDATES[0]]


def test_truth_table_covers_every_policy():
    assert set(TRUTH) == set(POLICY_NAMES)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_victim_order(policy):
    index = one_block_leaves(policy, HITS)
    assert eviction_order(index) == TRUTH[policy]
    assert index.num_blocks == 0 and index.num_nodes == 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_victim_order_without_hits(policy):
    index = one_block_leaves(policy, [])
    expected = "EDCBA" if policy in ("mru", "filo") else "ABCDE"
    assert eviction_order(index) == expected


@pytest.mark.parametrize(("reward", "expected"), [(0.0, "AB"), (10.0, "BA")])
def test_lru_hit_reward_lets_a_hot_old_leaf_outlive_a_newer_one(reward, expected):
    # A: inserted at 0, hit at 1, 2, 3 -> effective 3 + 3 * reward.
    # B: inserted at 20, never hit -> effective 20.
    clock = FakeClock()
    index = make_index("lru", clock, hit_reward_seconds=reward)
    index.insert(keys(1), np.array([0]), ready=True)
    for t in (1.0, 2.0, 3.0):
        clock.set(t)
        index.match(keys(1), touch=True)
    clock.set(20.0)
    index.insert(keys(2), np.array([1]), ready=True)
    assert eviction_order(index) == expected


def test_s3fifo_one_hit_wonders_go_before_reused_nodes():
    # Four leaves in S; B and D are hit again, so they move to M and outlive
    # A and C even though they were inserted earlier than C.
    index = one_block_leaves("s3fifo", [(10.0, "B"), (11.0, "D")])
    assert eviction_order(index) == "ACEBD"


def test_s3fifo_ghost_hit_on_reinsert_enters_main():
    clock = FakeClock()
    index = make_index("s3fifo", clock)
    index.insert(keys(1), np.array([0]), ready=True)  # A
    index.insert(keys(2), np.array([1]), ready=True)  # B
    assert key_ids(index.evict(1).runs[0].key_bytes) == [1]  # A -> ghost
    index.insert(keys(1), np.array([0]), ready=True)  # A again: ghost hit -> M
    index.insert(keys(3), np.array([2]), ready=True)  # C -> S
    index.insert(keys(4), np.array([3]), ready=True)  # D -> S
    # Without the ghost A would sit in S behind B: order B A C D.
    assert eviction_order(index) == "BCDA"


def test_s3fifo_ghost_remembers_the_tail_a_partial_eviction_took():
    index = make_index("s3fifo", FakeClock())
    index.insert(chain(4), np.arange(4), ready=True)  # one node, blocks 1..4, in S
    assert key_ids(index.evict(2).runs[0].key_bytes) == [3, 4]  # the node keeps 1..2
    node = index.insert(chain(4), np.array([4, 5]), ready=True).node  # 3..4 come back
    assert key_ids(node.key_bytes) == [3, 4]
    assert node.policy_state.queue == MAIN  # a ghost hit: 3 was remembered, not 1


def test_s3fifo_blocks_bounds_its_ghost_by_blocks_not_nodes():
    # 10 cached blocks: the ghost keeps at most 9 blocks' worth of first keys.
    # s3fifo's would keep 1,024 entries, however many blocks each stands for.
    index = make_index("s3fifo_blocks", FakeClock())
    policy = index.policy
    for i in range(10):  # ten 1-block nodes
        index.insert(keys(100 + i), np.array([i]), ready=True)
    for i in range(10):  # then 3-block nodes: each evicts 3 blocks to the ghost
        index.evict(3)
        index.insert(chain(3, start=1000 + 10 * i), np.arange(10 + 3 * i, 13 + 3 * i), ready=True)
    assert sum(policy._ghosts[0].values()) <= 0.9 * index.num_blocks
    assert len(policy._ghosts[0]) < 10


def test_s3fifo_blocks_sends_a_returning_nodes_unused_tail_back_to_s():
    index = make_index("s3fifo_blocks", FakeClock())
    index.insert(keys(1), np.array([0]), ready=True)  # A, in S
    for i in range(10):  # ten more 1-block leaves, so the ghost may hold 9 blocks
        index.insert(keys(50 + i), np.array([10 + i]), ready=True)
    index.evict(1)  # A -> ghost
    node = index.insert(chain(3, start=1), np.array([0, 2, 3]), ready=True).node  # A 2 3
    assert node.policy_state.queue == MAIN  # back from the ghost, whole
    assert index.policy.queue_blocks == (10, 3)
    index.match(keys(1), touch=True)  # a match of A alone splits off "2 3", unused
    tail = index.match(chain(3, start=1)).node
    assert key_ids(tail.key_bytes) == [2, 3] and tail.policy_state.queue == SMALL
    head = tail.parent
    assert key_ids(head.key_bytes) == [1] and head.policy_state.queue == MAIN
    assert index.policy.queue_blocks == (12, 1)
    assert tail.heap_token is not None  # still a candidate, now in S's heap
    assert index.evict(13).num_blocks == 13 and index.num_blocks == 0


def test_s3fifo_main_node_is_reinserted_while_it_has_hits():
    clock = FakeClock()
    index = make_index("s3fifo", clock)
    for i in range(1, 4):
        index.insert(keys(i), np.array([i]), ready=True)
    index.match(keys(1), touch=True)
    index.match(keys(2), touch=True)
    # One pass over S: A and B move to M with their count reset, C is evicted.
    assert eviction_order_n(index, 1) == "C"
    index.match(keys(1), touch=True)  # A, now in M, is hit again
    # M: A has a hit, so it goes back to the tail behind B.
    assert eviction_order(index) == "BA"


def test_make_policy_errors():
    with pytest.raises(ValueError) as err:
        make_policy("random")
    for name in POLICY_NAMES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="hit_reward_seconds"):
        make_policy("lru", -1.0)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_make_policy_names(policy):
    assert make_policy(policy).name == policy


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("parent_first", [True, False], ids=["parent-older", "parent-newer"])
def test_parent_is_a_candidate_only_once_its_children_are_gone(policy, parent_first):
    clock = FakeClock()
    index = make_index(policy, clock)
    parent_keys = keys(1, 2)
    child_keys = keys(1, 2, 3)
    index.insert(parent_keys, np.array([0, 1]), ready=True)
    if not parent_first:
        clock.set(1.0)
        index.match(parent_keys, touch=True)
    clock.set(2.0)
    index.insert(child_keys, np.array([2]), ready=True)
    if not parent_first:
        clock.set(3.0)
        index.match(parent_keys, touch=True)  # the parent is now the most recent
    index.insert(keys(9), np.array([3]), ready=True)  # an unrelated leaf
    assert index.policy.num_candidates == 2
    order = []
    while (result := index.evict(1)).num_blocks:
        order += key_ids(result.runs[0].key_bytes)
    assert sorted(order) == [1, 2, 3, 9]
    # The child goes before its parent, and the parent from its tail.
    assert order.index(3) < order.index(2) < order.index(1)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_locked_and_unready_leaves_are_never_victims(policy):
    index = make_index(policy)
    locked = index.insert(keys(1), np.array([0]), ready=True).node
    index.insert(keys(2), np.array([1]), ready=False)
    index.insert(keys(3), np.array([2]), ready=True)
    index.insert(keys(4), np.array([3]), ready=True)
    deep = index.insert(keys(4, 5), np.array([4]), ready=True).node
    index.lock(locked)
    index.lock(deep)  # protects keys 4 and 5
    result = index.evict(100)
    assert result.num_blocks == 1
    assert key_ids(result.runs[0].key_bytes) == [3]
    assert index.evict(100).num_blocks == 0
    assert index.num_blocks == 4
    index.unlock(locked)
    assert key_ids(index.evict(100).runs[0].key_bytes) == [1]
    index.unlock(deep)
    assert index.evict(100).num_blocks == 2
    assert index.num_blocks == 1  # only the unready block is left
    assert index.match(keys(2)).num_present == 1


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_evict_zero_does_nothing(policy):
    index = one_block_leaves(policy, HITS)
    result = index.evict(0)
    assert result.num_blocks == 0 and result.runs == [] and result.slots.size == 0
    assert index.num_blocks == 5 and index.policy.num_candidates == 5
    assert eviction_order(index) == TRUTH[policy]


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_partial_last_victim_leaves_exactly_the_prefix(policy, n):
    index = make_index(policy)
    run = chain(5)
    slots = np.array([10, 11, 12, 13, 14])
    index.insert(run, slots, ready=True)
    result = index.evict(n)
    assert result.num_blocks == n
    assert key_ids(b"".join(r.key_bytes for r in result.runs)) == list(range(6 - n, 6))
    assert result.slots.tolist() == slots[5 - n :].tolist()
    assert index.num_blocks == 5 - n
    m = index.match(run)
    assert m.num_blocks == m.num_present == 5 - n
    assert m.slots.tolist() == slots[: 5 - n].tolist()
    # What is left is still a candidate and goes next.
    assert index.evict(10).num_blocks == 5 - n
    assert index.num_blocks == 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_evict_more_than_evictable_takes_all(policy):
    index = one_block_leaves(policy, HITS)
    result = index.evict(50)
    assert result.num_blocks == 5
    assert sorted(result.slots.tolist()) == [0, 1, 2, 3, 4]


def build_leaves(policy: str, n: int):
    clock = FakeClock()
    index = make_index(policy, clock)
    run = chain(n)
    slots = np.arange(n)
    for i in range(n):
        clock.set(float(i))
        index.insert(run[i : i + 1], slots[i : i + 1], ready=True)
    return index


def evict_time(index, n: int) -> float:
    start = time.perf_counter()
    assert index.evict(n).num_blocks == n
    return time.perf_counter() - start


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_eviction_cost_does_not_grow_with_the_index(policy):
    # 100k vs 1k leaves (building 200k per policy costs seconds): a scan per
    # victim would make the big case ~100x slower; O(log n) makes it ~1.7x.
    big = build_leaves(policy, 100_000)
    big_time = min(evict_time(big, 500) for _ in range(3))
    small_time = min(evict_time(build_leaves(policy, 1000), 500) for _ in range(3))
    assert big_time <= 20 * small_time, (big_time, small_time)


# ---- nodes that move between candidate heaps ----------------------------------------


@pytest.fixture(params=["c", "python"])
def heap(request, monkeypatch):
    """Run the test on the C candidate heap, then on the Python reference."""
    import sidecar.control.policies as policies
    import sidecar.control.s3fifo as s3fifo

    if request.param == "python":
        monkeypatch.setattr(policies, "NodeHeap", policies.LazyHeap)
        monkeypatch.setattr(s3fifo, "NodeHeap", policies.LazyHeap)
    elif policies.NodeHeap is policies.LazyHeap:
        pytest.skip("sidecar.control._nodeheap is not built")
    return request.param


def ticking():
    """A clock one second further on at each reading."""
    ticks = itertools.count(1)
    return lambda: float(next(ticks))


def candidates(index) -> dict[int, int]:
    return {ns: space.policy.num_candidates for ns, space in index._spaces.items()}


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_tree_taken_over_by_a_namespace_is_evicted_whole(policy, heap):
    """A request of namespace 5 extending a namespace-0 tree (blocks the SSD
    tier recovered) moves the tree's candidates to namespace 5's policy. The
    old heap keeps stale entries: when heaps counted tokens each from 1, one
    came back to life under a token the new heap handed out, and candidate
    counts went wrong (a block no eviction could take; an AssertionError in
    s3fifo and arc evicting namespace 5)."""
    from contract.ids import keys_from_ints
    from sidecar.control.cache_engine import CacheEngine

    engine = CacheEngine("ssd", 100, policy, 1.0, 0.0, clock=ticking())
    index = engine.index

    def put(ns: int, *ids: int) -> None:
        keys = keys_from_ints(np.array(ids))
        present = index.match(keys).num_blocks
        index.insert(keys, engine.allocate(len(keys) - present), ready=True, ns=ns)

    for ids in ((1, 2), (1, 2, 3), (1, 2, 4), (50,)):
        put(0, *ids)
    put(5, 100)
    put(5, 101)
    put(5, 1, 2, 3, 9)  # takes over the tree under (1, 2)
    assert sum(candidates(index).values()) == 5  # (4), (9), (50), (100), (101)
    assert index.evict(100).num_blocks == 8 and index.num_blocks == 0
    assert set(candidates(index).values()) == {0}
    assert index.evict(1, ns=5).num_blocks == 0


@pytest.mark.parametrize("policy", ["s3fifo_blocks", "auto"])
def test_a_split_moving_its_tail_back_to_s_keeps_both_queues_counts(policy, heap):
    """S3-FIFO-blocks moves a split node's unused tail from M back to S,
    leaving a stale entry in M's heap. With per-heap token counts, S's next
    token equalled it: M popped the node, S's count stayed 1 with nothing
    behind it, and every later eviction raised mid-way (its victims' slots
    never freed). `auto` follows this policy first."""
    from contract.ids import keys_from_ints
    from sidecar.control.cache_engine import CacheEngine

    engine = CacheEngine("cpu", 20, policy, 1.0, 0.0, clock=ticking())
    index = engine.index
    first, second = keys_from_ints(np.arange(1000, 1010)), keys_from_ints(np.array([1, 2, 3]))

    def put(keys) -> None:
        present = index.match(keys).num_blocks
        index.insert(keys, engine.allocate(len(keys) - present), ready=True)

    put(first)
    index.match(first, touch=True)
    put(second)
    engine.evict(3)
    index.match(first, touch=True)
    index.match(first, touch=True)
    put(second)  # back from the ghost, into M
    index.match(second[:2], touch=True)  # splits off (3), sent back to S
    engine.evict(100)
    assert index.num_blocks == 0 and engine.mempool.num_used == 0
    assert set(candidates(index).values()) == {0}
