"""Namespaces in the control plane: tagging, counts, per-namespace eviction,
quotas, TTL, clear by namespace, peek, and the planner threading `ns`."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FakeClock, chain, finish, gpu, key_ids, make_engine, make_index, walk
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.control import policies
from sidecar.control.events import BlockRemoved
from sidecar.control.index import IndexConflict
from sidecar.control.node import RadixNode
from sidecar.control.planner import GlobalCacheEngine
from sidecar.control.policies import POLICY_NAMES, LazyHeap


def ns_keys(ns: int, n: int, start: int = 1):
    """A chain salted by namespace, as the server's keys are."""
    return chain(n, start, high=100 + ns)


def recount(index) -> dict[int, int]:
    counts: dict[int, int] = {}
    for node in walk(index.root):
        if node.parent is not None:
            counts[node.ns] = counts.get(node.ns, 0) + len(node)
    return {ns: n for ns, n in counts.items() if n}


# ---- tagging and counts --------------------------------------------------------


def test_insert_tags_the_nodes_and_counts_per_namespace():
    clock = FakeClock(5.0)
    index = make_index("lru", clock)
    index.insert(ns_keys(1, 4), np.arange(4), ready=True, ns=1)
    index.insert(ns_keys(2, 3), np.arange(4, 7), ready=True, ns=2)
    index.insert(chain(2, high=7), np.arange(7, 9), ready=True)
    assert index.namespace_blocks() == {0: 2, 1: 4, 2: 3} == recount(index)
    assert (index.blocks_of(1), index.blocks_of(9)) == (4, 0)
    node = index.match(ns_keys(1, 4)).node
    assert (node.ns, node.born) == (1, 5.0)


def test_a_split_keeps_namespace_and_birth_on_both_halves():
    clock = FakeClock(1.0)
    index = make_index("lru", clock)
    index.insert(ns_keys(3, 6), np.arange(6), ready=True, ns=3)
    clock.set(2.0)
    branch = np.concatenate([ns_keys(3, 3), chain(2, 50, high=103)])
    index.insert(branch, np.arange(6, 8), ready=True, ns=3)
    upper = index.match(ns_keys(3, 3)).node
    lower = index.match(ns_keys(3, 6)).node
    assert upper is not lower and lower.parent is upper
    assert [(n.ns, n.born) for n in (upper, lower)] == [(3, 1.0), (3, 1.0)]
    assert index.match(branch).node.born == 2.0
    assert index.namespace_blocks() == {3: 8} == recount(index)


def test_blocks_below_a_tree_join_its_namespace():
    index = make_index()
    index.insert(ns_keys(1, 2), np.arange(2), ready=True, ns=1)
    index.insert(ns_keys(1, 4), np.arange(2, 4), ready=True)  # no namespace given
    index.insert(ns_keys(1, 5), np.arange(4, 5), ready=True, ns=2)  # a wrong one
    assert index.namespace_blocks() == {1: 5} == recount(index)


def test_a_namespaced_insert_claims_a_recovered_tree():
    """Blocks recovered from disk have namespace 0 until a request extends them."""
    index = make_index()
    index.insert(ns_keys(4, 3), np.arange(3), ready=True)
    index.insert(np.concatenate([ns_keys(4, 1), chain(1, 60, high=104)]), [3], ready=True)
    index.insert(ns_keys(4, 5), np.arange(4, 6), ready=True, ns=4)
    assert index.namespace_blocks() == {4: 6} == recount(index)
    assert index.evict(6, ns=4).num_blocks == 6 and index.num_blocks == 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_recovered_tree_claimed_at_a_register_is_aged_from_its_write(policy):
    """`claim`: a namespace-0 tree moves whole to the namespace its journal
    named, its TTL counting from the write (`age` seconds ago); anything
    else is refused and nothing changes."""
    clock = FakeClock(100.0)
    index = make_index(policy, clock)
    top = index.insert(ns_keys(3, 3), np.arange(3), ready=True).node
    index.insert(ns_keys(3, 5), np.arange(3, 5), ready=True)
    mine = index.insert(ns_keys(4, 2), np.arange(5, 7), ready=True, ns=4).node
    assert top is not None and mine is not None
    for bad_top, bad_ns in ((top, 0), (mine, 3), (top.children[ns_keys(3, 4)[3].tobytes()], 3)):
        with pytest.raises(IndexConflict):
            index.claim(bad_top, bad_ns, 5.0)
    assert index.namespace_blocks() == {0: 5, 4: 2}
    index.set_ttl(3, 10.0)
    assert index.claim(top, 3, 8.0) == 5  # written 8 s ago
    assert index.namespace_blocks() == {3: 5, 4: 2} == recount(index)
    assert index.match(ns_keys(3, 5)).num_blocks == 5
    clock.set(102.5)  # 10.5 s after the write: expired, though claimed 2.5 s ago
    assert index.match(ns_keys(3, 5)).num_blocks == 0
    assert index.expire().size == 5 and index.namespace_blocks() == {4: 2}
    assert index.evict(2, ns=4).num_blocks == 2  # the policies kept count


def test_counts_follow_partial_eviction_discard_and_remove():
    index = make_index()
    index.insert(ns_keys(1, 5), np.arange(5), ready=True, ns=1)
    pending = index.insert(ns_keys(2, 3), np.arange(5, 8), ns=2).node
    assert index.evict(2).num_blocks == 2  # a tail of namespace 1's node
    assert index.namespace_blocks() == {1: 3, 2: 3} == recount(index)
    index.discard(pending)
    assert index.namespace_blocks() == {1: 3} == recount(index)
    index.remove(ns_keys(1, 2))
    assert index.namespace_blocks() == {1: 1} == recount(index)


# ---- eviction by namespace and peek ----------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_evict_by_namespace_takes_only_its_blocks(policy):
    index = make_index(policy)
    for ns in (1, 2, 3):
        index.insert(ns_keys(ns, 4), np.arange(4 * ns, 4 * ns + 4), ready=True, ns=ns)
    result = index.evict(3, ns=2)
    assert result.num_blocks == 3 and all(run.ns == 2 for run in result.runs)
    assert index.namespace_blocks() == {1: 4, 2: 1, 3: 4}
    assert index.evict(5, ns=7).num_blocks == 0


def test_eviction_across_namespaces_keeps_one_lru_order():
    clock = FakeClock()
    index = make_index("lru", clock)
    for t, ns in enumerate([1, 2, 1, 3, 2]):
        clock.set(float(t))
        index.insert(chain(1, t + 1, high=100 + ns), [t], ready=True, ns=ns)
    clock.set(9.0)
    index.match(chain(1, 1, high=101), touch=True)  # the oldest becomes the newest
    order = [key_ids(index.evict(1).runs[0].key_bytes)[0] for _ in range(5)]
    assert order == [2, 3, 4, 5, 1]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_next_victim_age_peeks_without_side_effects(policy):
    clock = FakeClock()
    index = make_index(policy, clock)
    assert index.next_victim_age() is None
    for t in range(3):
        clock.set(float(t))
        index.insert(chain(1, t + 1, high=100 + t), [t], ready=True, ns=t)
    candidates = index.num_candidates
    age = index.next_victim_age()
    assert age == index.next_victim_age() and index.num_candidates == candidates == 3
    victim = index.evict(1).runs[0]
    if policy in ("lru", "fifo", "lfu", "s3fifo", "arc"):
        assert age == 0.0 and key_ids(victim.key_bytes) == [1]
    elif policy in ("mru", "filo"):
        assert age == 2.0 and key_ids(victim.key_bytes) == [3]


@pytest.mark.parametrize("heap_type", [LazyHeap, policies.NodeHeap])
def test_heap_peek_skips_stale_entries_and_changes_nothing(heap_type):
    heap = heap_type()
    nodes = [RadixNode(b"", np.empty(0, dtype=np.int64), None, True, 0.0, i) for i in range(4)]
    assert heap.peek() is None
    for i, node in enumerate(nodes):
        heap.push(node, float(4 - i), 0.0, 0)
    assert heap.peek() is nodes[3] and heap.size == 4
    heap.remove(nodes[3])
    heap.push(nodes[2], 9.0, 0.0, 0)  # its old entry is stale now
    assert heap.peek() is nodes[1] and heap.size == 3
    assert [heap.pop() for _ in range(4)] == [nodes[1], nodes[0], nodes[2], None]
    assert heap.peek() is None


HEAP_OPS = st.lists(
    st.tuples(
        st.sampled_from(["push", "push", "remove", "pop", "peek"]),
        st.integers(0, 5),
        st.sampled_from([0.0, 1.0, 2.0]),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops=HEAP_OPS)
def test_c_heap_peek_matches_the_reference(ops):
    """peek() is what the next pop() returns, on both heaps, and changes no size."""
    pair = []
    for heap_type in (LazyHeap, policies.NodeHeap):
        nodes = [RadixNode(b"", np.empty(0, dtype=np.int64), None, True, 0.0, i) for i in range(6)]
        pair.append((heap_type(), nodes))
    for op, i, k0 in ops:
        seen = []
        for heap, nodes in pair:
            if op == "push":
                heap.push(nodes[i], k0, 0.0, i)
            elif op == "remove":
                heap.remove(nodes[i])
            else:
                size = heap.size
                peeked = heap.peek()
                got = heap.pop() if op == "pop" else heap.peek()
                assert got is peeked
                assert heap.size == size - (op == "pop" and got is not None)
                seen.append(None if got is None else nodes.index(got))
        assert len(set(seen)) <= 1


# ---- quotas ------------------------------------------------------------------------


def test_allocate_under_a_quota_evicts_the_namespace_own_blocks_first():
    engine = make_engine("cpu", 20)
    engine.set_quota(1, 6)
    for start in (1, 11):
        keys = ns_keys(1, 4, start)
        engine.insert(keys, engine.allocate(4, ns=1), ready=True, ns=1)
    other = ns_keys(2, 4)
    engine.insert(other, engine.allocate(4, ns=2), ready=True, ns=2)
    assert engine.index.namespace_blocks() == {1: 6, 2: 4}  # two of ns 1's went
    assert engine.match(ns_keys(1, 4, 1)).num_blocks == 2  # the older chain lost its tail
    assert engine.match(other).num_blocks == 4


def test_a_quota_hands_out_only_what_fits_when_the_rest_is_locked():
    engine = make_engine("cpu", 20)
    engine.set_quota(1, 5)
    keys = ns_keys(1, 4)
    engine.insert(keys, engine.allocate(4, ns=1), ready=True, ns=1)
    engine.lock(engine.match(keys).node)
    assert engine.allocate(3, ns=1).size == 1
    engine.set_quota(1, 2)  # lower than what is locked: nothing goes, nothing fits
    assert engine.allocate(3, ns=1).size == 0 and engine.index.blocks_of(1) == 4
    assert engine.mempool.num_used == 5  # the slot handed out above is the caller's


def test_general_eviction_takes_namespaces_over_quota_first():
    clock = FakeClock()
    engine = make_engine("cpu", 10, clock=clock)
    engine.set_quota(1, 2)
    engine.insert(ns_keys(2, 4), engine.allocate(4, ns=2), ready=True, ns=2)  # the oldest
    clock.set(1.0)
    engine.insert(ns_keys(1, 4), engine.allocate(4), ready=True)  # recovered: namespace 0
    engine.insert(ns_keys(1, 5), engine.allocate(1, ns=1), ready=True, ns=1)  # claims it
    assert engine.index.namespace_blocks() == {1: 5, 2: 4}  # over its quota
    assert engine.allocate(2, ns=3).size == 2
    assert engine.index.namespace_blocks() == {1: 4, 2: 4}  # not the older ns 2


def test_set_quota_evicts_down_and_rejects_negative():
    engine = make_engine("cpu", 8)
    keys = ns_keys(1, 6)
    engine.insert(keys, engine.allocate(6, ns=1), ready=True, ns=1)
    engine.set_quota(1, 2)
    assert engine.index.blocks_of(1) == 2 and engine.mempool.num_used == 2
    with pytest.raises(ValueError):
        engine.set_quota(1, -1)
    engine.set_quota(1, None)
    assert engine.quota(1) is None and engine.allocate(6, ns=1).size == 6


# ---- TTL -----------------------------------------------------------------------------


def test_an_expired_tree_is_not_served_then_expire_drops_it():
    clock = FakeClock(0.0)
    engine = make_engine("cpu", 16, clock=clock, record_events=True)
    index = engine.index
    keys = ns_keys(1, 4)
    engine.insert(keys, engine.allocate(4, ns=1), ready=True, ns=1)
    clock.set(5.0)
    engine.insert(ns_keys(1, 6), engine.allocate(2, ns=1), ready=True, ns=1)
    engine.insert(ns_keys(2, 3), engine.allocate(3, ns=2), ready=True, ns=2)
    index.set_ttl(1, 10.0)
    clock.set(10.0)
    assert index.match(ns_keys(1, 6)).num_blocks == 6
    clock.set(10.5)  # the top is 10.5 s old: the whole tree goes
    m = index.match(ns_keys(1, 6))
    assert (m.num_blocks, m.num_present, m.node) == (0, 6, None)
    assert index.ready_blocks(ns_keys(1, 6).tobytes()) == 0
    assert index.match(ns_keys(2, 3)).num_blocks == 3  # no TTL there
    index.drain_events()
    assert engine.expire() == 6 and engine.mempool.num_used == 3
    assert index.namespace_blocks() == {2: 3}
    assert sum(len(e.keys) for e in index.drain_events() if isinstance(e, BlockRemoved)) == 6
    index.set_ttl(1, None)
    engine.insert(keys, engine.allocate(4, ns=1), ready=True, ns=1)
    clock.set(1000.0)
    assert index.match(keys).num_blocks == 4


def test_a_locked_expired_tree_is_kept_and_retried():
    clock = FakeClock(0.0)
    engine = make_engine("cpu", 16, clock=clock)
    engine.index.set_ttl(1, 1.0)
    keys = ns_keys(1, 4)
    engine.insert(keys, engine.allocate(4, ns=1), ready=True, ns=1)
    engine.insert(ns_keys(1, 2, 30), engine.allocate(2, ns=1), ready=True, ns=1)
    node = engine.match(keys).node
    engine.lock(node)
    clock.set(3.0)
    assert engine.expire() == 2 and engine.index.blocks_of(1) == 4
    engine.unlock(node)
    assert engine.expire() == 4 and engine.mempool.num_used == 0


def test_expire_after_a_split_of_the_top_drops_the_whole_tree():
    clock = FakeClock(0.0)
    engine = make_engine("cpu", 16, clock=clock)
    engine.index.set_ttl(1, 1.0)
    engine.insert(ns_keys(1, 4), engine.allocate(4, ns=1), ready=True, ns=1)
    clock.set(0.5)
    branch = np.concatenate([ns_keys(1, 2), chain(1, 70, high=101)])
    engine.insert(branch, engine.allocate(1, ns=1), ready=True, ns=1)
    clock.set(1.2)  # the top (born 0) is expired, the branch (born 0.5) is not
    assert engine.match(branch).num_blocks == 0
    assert engine.expire() == 5 and engine.index.num_nodes == 0


# ---- clear by namespace ------------------------------------------------------------


def branch_of(ns: int):
    """A 2-block branch off the first 2 blocks of ns_keys(ns, ...)."""
    return np.concatenate([ns_keys(ns, 2), chain(2, 80, high=100 + ns)])


def test_clear_namespace_removes_its_unlocked_blocks_only():
    engine = make_engine("cpu", 32, record_events=True)
    dropped: list[np.ndarray] = []
    engine.remove_hook = dropped.append
    for ns in (1, 2):
        engine.insert(ns_keys(ns, 4), engine.allocate(4, ns=ns), ready=True, ns=ns)
        engine.insert(branch_of(ns), engine.allocate(2, ns=ns), ready=True, ns=ns)
    pending = engine.insert(ns_keys(1, 5), engine.allocate(1, ns=1), ns=1).node
    engine.lock(engine.match(branch_of(1)).node)
    engine.index.drain_events()
    # Every namespace 1 node is locked, in flight or above such a node.
    assert engine.clear_namespace(1) == (0, 7)
    assert engine.index.namespace_blocks() == {1: 7, 2: 6}
    engine.unlock(engine.match(branch_of(1)).node)
    engine.discard(pending)
    assert engine.clear_namespace(1) == (6, 0)
    assert engine.index.namespace_blocks() == {2: 6}
    assert engine.mempool.num_used == 6
    assert sum(s.size for s in dropped) == 6  # every namespace 1 block, once
    assert any(isinstance(e, BlockRemoved) for e in engine.index.drain_events())


def test_clear_namespace_reports_kept_blocks():
    engine = make_engine("cpu", 32)
    engine.insert(ns_keys(1, 4), engine.allocate(4, ns=1), ready=True, ns=1)
    engine.insert(branch_of(1), engine.allocate(2, ns=1), ready=True, ns=1)
    engine.insert(ns_keys(1, 3, 40), engine.allocate(3, ns=1), ready=True, ns=1)
    engine.lock(engine.match(branch_of(1)).node)
    # The locked branch and the 2 blocks above it stay; the other arm (2) and
    # the separate tree (3) go.
    assert engine.clear_namespace(1) == (5, 4)
    assert engine.match(branch_of(1)).num_blocks == 4


def test_clear_drops_everything_unlocked_through_the_remove_hook():
    engine = make_engine("cpu", 16)
    dropped: list[np.ndarray] = []
    engine.remove_hook = dropped.append
    for ns in (0, 1, 2):
        engine.insert(ns_keys(ns, 3), engine.allocate(3, ns=ns), ready=True, ns=ns)
    engine.lock(engine.match(ns_keys(2, 3)).node)
    assert engine.clear() == (6, 3)
    assert engine.index.namespace_blocks() == {2: 3} and sum(s.size for s in dropped) == 6


# ---- the planner ---------------------------------------------------------------------


def make_global(write_policy="write_through", cpu=16):
    return GlobalCacheEngine(
        make_engine("cpu", cpu), make_engine("ssd", 32), make_engine("remote", 32), write_policy
    )


def test_put_and_get_tag_every_tier_with_the_request_namespace():
    g = make_global()
    keys = ns_keys(5, 4)
    finish(g, g.put(keys, gpu(4), ns=5))
    assert g.namespace_usage() == {"cpu": {5: 4}, "ssd": {5: 4}, "remote": {5: 4}}
    g.clear_namespace(5, ["cpu"])
    plan = g.get(keys, gpu(4), ns=5)  # staged from SSD into the CPU tier
    assert plan.hit_blocks.ssd == 4
    finish(g, plan)
    assert g.namespace_usage()["cpu"] == {5: 4}
    assert g.learn_remote(ns_keys(6, 3), 3, ns=6) == 3
    assert g.namespace_usage()["remote"] == {5: 4, 6: 3}


def test_write_back_writes_down_in_the_evicted_namespace():
    g = make_global("write_back", cpu=4)
    finish(g, g.put(ns_keys(7, 4), gpu(4), ns=7))
    g.put(ns_keys(8, 4), gpu(4), ns=8)  # evicts ns 7's blocks: written back
    for plan in g.drain_background():
        finish(g, plan)
    assert g.namespace_usage()["ssd"] == {7: 4}


def test_planner_quotas_ttl_and_clear():
    g = make_global()
    g.set_quota("cpu", 1, 3)
    plan = g.put(ns_keys(1, 5), gpu(5), ns=1)
    assert plan.stored_blocks == 3
    finish(g, plan)
    assert g.namespace_usage()["cpu"] == {1: 3}
    with pytest.raises(ValueError):
        g.set_quota("tape", 1, 3)
    assert g.clear_namespace(1) == {"cpu": (3, 0), "ssd": (3, 0), "remote": (3, 0)}
    assert g.namespace_usage() == {"cpu": {}, "ssd": {}, "remote": {}}
    finish(g, g.put(ns_keys(2, 2), gpu(2), ns=2))
    assert g.clear(["ssd"]) == {"ssd": (2, 0)}


def test_planner_ttl_expires_every_tier_and_a_put_replaces_expired_blocks():
    clock = FakeClock(0.0)
    engines = [make_engine(n, 16, clock=clock) for n in ("cpu", "ssd")]
    g = GlobalCacheEngine(engines[0], engines[1])
    g.set_ttl(1, 10.0)
    keys = ns_keys(1, 4)
    finish(g, g.put(keys, gpu(4), ns=1))
    clock.set(11.0)
    assert g.lookup(keys).cpu == 0 and g.lookup(keys).ssd == 0
    plan = g.put(keys, gpu(4), ns=1)  # drops the expired trees, then stores afresh
    assert plan.stored_blocks == 4
    finish(g, plan)
    assert g.lookup(keys).cpu == 4
    clock.set(30.0)
    assert g.expire() == {"cpu": 4, "ssd": 4}
    assert g.namespace_usage() == {"cpu": {}, "ssd": {}}
