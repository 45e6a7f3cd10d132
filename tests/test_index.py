"""RadixIndex: matching, splits, insert preconditions, readiness, locks, events."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FakeClock, cat, chain, key_ids, keys, make_index, walk

from contract.ids import KEY_DTYPE
from sidecar.control.events import AllBlocksCleared, BlockRemoved, BlockStored
from sidecar.control.index import IndexConflict
from sidecar.control.policies import POLICY_NAMES

RUN = chain(5)  # ids 1..5
SLOTS = np.array([10, 11, 12, 13, 14])


@pytest.fixture(params=POLICY_NAMES)
def policy(request):
    return request.param


def stats(index):
    return [
        (n.key_bytes, n.last_access, n.access_seq, n.hit_count, n.lock_count, n.ready)
        for n in walk(index.root)
    ]


def shape(index):
    """Every node as (key ids, slots, ready), sorted: the index's whole content."""
    return sorted(
        (tuple(key_ids(n.key_bytes)), tuple(n.slots.tolist()), n.ready)
        for n in walk(index.root)
        if n.parent is not None
    )


def test_match_on_empty_index(policy):
    index = make_index(policy)
    for query in (RUN, chain(0)):
        m = index.match(query, touch=True)
        assert (m.num_blocks, m.num_present, m.node, m.pending) == (0, 0, None, None)
        assert m.slots.size == 0
    assert index.num_blocks == index.num_nodes == 0


def test_exact_partial_and_longer_matches(policy):
    index = make_index(policy)
    node = index.insert(RUN, SLOTS, ready=True).node
    exact = index.match(RUN)
    assert (exact.num_blocks, exact.num_present, exact.node) == (5, 5, node)
    assert exact.slots.tolist() == SLOTS.tolist()
    inside = index.match(RUN[:3])
    assert (inside.num_blocks, inside.node) == (3, node)
    assert inside.slots.tolist() == SLOTS[:3].tolist()
    longer = index.match(cat(RUN, keys(99)))
    assert (longer.num_blocks, longer.num_present) == (5, 5)
    assert index.match(keys(99)).num_blocks == 0
    assert index.num_nodes == 1  # matching never splits


def test_keys_read_from_a_frame_and_views_of_them_match_like_copies(policy):
    index = make_index(policy)
    index.insert(RUN, SLOTS, ready=True)
    frame = RUN.tobytes()  # keys as the sidecar gets them: a view of the message bytes
    wire = np.frombuffer(frame, dtype=KEY_DTYPE)
    for view in (wire, wire[:3], wire[2:], wire[::2], wire[::-1]):
        assert index.match(view).slots.tolist() == index.match(view.copy()).slots.tolist()
    assert index.match(wire).num_blocks == 5
    assert index.match(wire[::-1]).num_blocks == 0  # reversed: key 5 first, not a prefix


@pytest.mark.parametrize("at", range(5))
def test_divergence_at_every_position(policy, at):
    index = make_index(policy)
    index.insert(RUN, SLOTS, ready=True)
    other = cat(RUN[:at], chain(3, start=100))
    m = index.match(other)
    assert m.num_blocks == m.num_present == index.ready_blocks(other.tobytes()) == at
    assert m.slots.tolist() == SLOTS[:at].tolist()

    new = index.insert(other, np.array([20, 21, 22]), ready=True).node
    assert index.num_nodes == (2 if at == 0 else 3)
    assert index.num_blocks == 8
    # Both runs still match whole, with their slots aligned with their keys.
    assert index.match(RUN).slots.tolist() == SLOTS.tolist()
    assert index.match(other).slots.tolist() == [*SLOTS[:at].tolist(), 20, 21, 22]
    path_keys, path_slots = index.path(new)
    assert key_ids(path_keys.tobytes()) == [*range(1, at + 1), 100, 101, 102]
    assert path_slots.tolist() == [*SLOTS[:at].tolist(), 20, 21, 22]
    expected = {(tuple(range(at + 1, 6)), tuple(SLOTS[at:].tolist()), True)}
    expected.add(((100, 101, 102), (20, 21, 22), True))
    if at:
        expected.add((tuple(range(1, at + 1)), tuple(SLOTS[:at].tolist()), True))
    assert set(shape(index)) == expected


def test_repeated_splits_keep_slots_aligned(policy):
    index = make_index(policy)
    index.insert(chain(8), np.arange(100, 108), ready=True)
    branches = {}
    for at in (6, 2, 4, 1):
        branch = cat(chain(at), keys(50 + at, 60 + at))
        index.insert(branch, np.array([200 + at, 300 + at]), ready=True)
        branches[at] = branch
    assert index.match(chain(8)).slots.tolist() == list(range(100, 108))
    for at, branch in branches.items():
        m = index.match(branch)
        assert m.num_blocks == at + 2
        assert m.slots.tolist() == [*range(100, 100 + at), 200 + at, 300 + at]
    for node in walk(index.root):
        assert len(node.key_bytes) == 16 * node.slots.size


def test_match_without_touch_changes_no_stats(policy):
    clock = FakeClock()
    index = make_index(policy, clock)
    index.insert(RUN, SLOTS, ready=True)
    index.insert(cat(RUN[:2], keys(7)), np.array([7]), ready=True)
    before = stats(index)
    candidates = index.policy.num_candidates
    clock.set(50.0)
    index.match(RUN)
    index.match(RUN[:1])
    assert stats(index) == before
    assert index.policy.num_candidates == candidates


def test_match_with_touch_counts_a_hit_along_the_path(policy):
    clock = FakeClock()
    index = make_index(policy, clock)
    index.insert(RUN, SLOTS, ready=True)
    sibling = index.insert(cat(RUN[:2], keys(7)), np.array([7]), ready=True).node
    leaf = index.match(RUN).node  # blocks 3..5
    upper = leaf.parent  # blocks 1..2
    clock.set(50.0)
    index.match(RUN[:4], touch=True)  # ends inside the leaf: splits it after block 4
    middle = leaf.parent
    assert middle is not upper and middle.parent is upper
    assert (key_ids(middle.key_bytes), key_ids(leaf.key_bytes)) == ([3, 4], [5])
    assert (leaf.hit_count, leaf.last_access) == (0, 0.0)  # the tail was not hit
    clock.set(60.0)
    index.match(RUN, touch=True)
    hits = (leaf.hit_count, middle.hit_count, upper.hit_count, sibling.hit_count)
    assert hits == (1, 2, 2, 0)
    assert (leaf.last_access, middle.last_access, sibling.last_access) == (60.0, 60.0, 0.0)
    assert index.root.hit_count == 0
    index.match(RUN[:1], touch=True)
    assert (leaf.hit_count, upper.parent.hit_count) == (1, 3)


def test_match_without_touch_never_splits(policy):
    index = make_index(policy)
    index.insert(RUN, SLOTS, ready=True)
    before = shape(index), index.num_nodes
    assert index.match(RUN[:3]).num_blocks == 3
    assert (shape(index), index.num_nodes) == before


def test_lru_evicts_the_unmatched_tail_of_a_hit_node_first():
    clock = FakeClock()
    index = make_index("lru", clock)
    index.insert(RUN, SLOTS, ready=True)  # t=0
    clock.set(1.0)
    other = keys(90, 91)
    index.insert(other, np.array([20, 21]), ready=True)  # t=1
    clock.set(2.0)
    index.match(RUN[:3], touch=True)  # blocks 1..3 hit at t=2; 4..5 stay at t=0
    result = index.evict(2)
    assert [key_ids(r.key_bytes) for r in result.runs] == [[4, 5]]


def test_insert_needs_its_prefix_present(policy):
    index = make_index(policy)
    index.insert(RUN[:2], SLOTS[:2], ready=True)
    before = shape(index), index.num_blocks, index.num_nodes
    with pytest.raises(IndexConflict):
        index.insert(RUN, np.array([1]), ready=True)  # keys 3, 4 missing
    with pytest.raises(IndexConflict):
        index.insert(RUN[:2], np.array([1]), ready=True)  # key 2 already present
    with pytest.raises(IndexConflict):
        index.insert(RUN[:2], np.array([1, 2, 3]), ready=True)  # more slots than keys
    assert (shape(index), index.num_blocks, index.num_nodes) == before
    assert index.insert(RUN[:2], np.empty(0, dtype=np.int64)) == (None, 0)


def test_insert_below_an_unready_node_conflicts(policy):
    index = make_index(policy)
    index.insert(RUN[:2], SLOTS[:2], ready=True)
    pending = index.insert(RUN[:4], SLOTS[2:4]).node
    before = shape(index)
    with pytest.raises(IndexConflict):
        index.insert(RUN, SLOTS[4:])  # below the pending node
    with pytest.raises(IndexConflict):
        index.insert(cat(RUN[:3], keys(9)), np.array([9]))  # inside it
    assert shape(index) == before
    index.set_ready(pending)
    index.insert(RUN, SLOTS[4:], ready=True)
    assert index.match(RUN).slots.tolist() == SLOTS.tolist()


def test_pending_node_is_reported_but_not_served(policy):
    index = make_index(policy)
    index.insert(RUN[:2], SLOTS[:2], ready=True)
    pending = index.insert(RUN, SLOTS[2:]).node
    m = index.match(RUN)
    assert (m.num_blocks, m.num_present, m.pending) == (2, 5, pending)
    assert index.ready_blocks(RUN.tobytes()) == 2
    assert m.slots.tolist() == SLOTS[:2].tolist()
    assert index.match(RUN[:4]).num_present == 4
    only_pending = make_index(policy)
    node = only_pending.insert(RUN, SLOTS).node
    m = only_pending.match(RUN[:3], touch=True)
    assert (m.num_blocks, m.num_present, m.node, m.pending) == (0, 3, None, node)
    assert node.hit_count == 0
    assert only_pending.ready_blocks(RUN.tobytes()) == 0
    index.set_ready(pending)
    assert index.match(RUN).num_blocks == index.ready_blocks(RUN.tobytes()) == 5


def test_set_ready_twice_conflicts(policy):
    index = make_index(policy)
    node = index.insert(RUN, SLOTS).node
    index.set_ready(node)
    with pytest.raises(IndexConflict):
        index.set_ready(node)
    ready = index.insert(keys(9), np.array([0]), ready=True).node
    with pytest.raises(IndexConflict):
        index.set_ready(ready)


def test_set_ready_front_serves_the_front_of_a_pending_node(policy):
    index = make_index(policy, record_events=True)
    index.insert(RUN[:1], SLOTS[:1], ready=True)
    pending = index.insert(RUN, SLOTS[1:]).node
    index.lock(pending)
    index.set_ready_front(pending, 3)  # blocks 1 of 1..4 landed
    m = index.match(RUN)
    assert (m.num_blocks, m.num_present, m.pending) == (2, 5, pending)
    assert len(pending) == 3 and not pending.ready
    index.set_ready_front(pending, 3)  # nothing more landed: nothing to do
    assert index.match(RUN).num_blocks == 2
    with pytest.raises(ValueError):
        index.set_ready_front(pending, 0)
    assert index.ready_blocks(RUN.tobytes()) == 2
    index.set_ready_front(pending, 1)
    assert index.match(RUN).num_blocks == 4
    index.set_ready(pending)
    assert index.match(RUN).slots.tolist() == SLOTS.tolist()
    assert index.fronts_readied == 2
    stored = [e for e in index.drain_events() if isinstance(e, BlockStored)]
    assert [len(e.keys) for e in stored] == [1, 1, 2, 1]  # each part once, in order
    index.unlock(pending)
    with pytest.raises(IndexConflict):
        index.set_ready_front(pending, 1)  # ready already
    assert index.evict(5).num_blocks == 5  # the policy knows every part
    assert shape(index) == []


def test_discard(policy):
    index = make_index(policy)
    ready = index.insert(RUN[:2], SLOTS[:2], ready=True).node
    pending = index.insert(RUN, SLOTS[2:]).node
    index.lock(pending)
    for node in (ready, pending, index.root):
        with pytest.raises(IndexConflict):
            index.discard(node)
    assert index.num_blocks == 5
    index.unlock(pending)
    assert index.discard(pending).tolist() == SLOTS[2:].tolist()
    assert (index.num_blocks, index.num_nodes) == (2, 1)
    assert index.match(RUN).num_present == 2
    # The parent is a leaf again, so it can be evicted.
    assert index.evict(5).num_blocks == 2


def test_lock_counts_along_the_path(policy):
    index = make_index(policy)
    a = index.insert(RUN[:2], SLOTS[:2], ready=True).node
    b = index.insert(RUN[:4], SLOTS[2:4], ready=True).node
    c = index.insert(RUN, SLOTS[4:], ready=True).node
    index.lock(c)
    index.lock(b)
    assert [n.lock_count for n in (index.root, a, b, c)] == [2, 2, 2, 1]
    index.unlock(c)
    assert [n.lock_count for n in (index.root, a, b, c)] == [1, 1, 1, 0]
    with pytest.raises(IndexConflict):
        index.unlock(c)
    assert [n.lock_count for n in (index.root, a, b, c)] == [1, 1, 1, 0]
    assert index.evict(5).num_blocks == 1  # only c
    index.unlock(b)
    assert [n.lock_count for n in (index.root, a, b)] == [0, 0, 0]
    assert index.evict(5).num_blocks == 4


def test_became_evictable_counts_what_a_load_short_of_slots_waits_for(policy):
    """Made ready, unlocked, or left a leaf: each counts once; a lock, an
    unlock that leaves a node locked or above a pending one, counts none."""
    index = make_index(policy)
    head = index.insert(RUN[:2], SLOTS[:2], ready=True).node
    assert index.became_evictable == 1  # made ready, a leaf
    tail = index.insert(RUN, SLOTS[2:]).node  # pending below: head is no candidate now
    index.lock(head)
    index.lock(head)
    index.unlock(head)
    index.unlock(head)  # unlocked, but above a pending node
    assert index.became_evictable == 1
    index.discard(tail)  # head is a leaf again (the slots may stay held: an orphan)
    assert index.became_evictable == 2
    tail = index.insert(RUN, SLOTS[2:]).node
    index.lock(tail)
    index.set_ready(tail)  # ready but locked
    assert index.became_evictable == 2
    index.unlock(tail)
    assert index.became_evictable == 3


def test_split_of_a_locked_node_keeps_its_locks(policy):
    index = make_index(policy)
    node = index.insert(RUN, SLOTS, ready=True).node
    index.lock(node)
    index.insert(cat(RUN[:2], keys(9)), np.array([9]), ready=True)
    upper = node.parent
    assert (upper.lock_count, node.lock_count, index.root.lock_count) == (1, 1, 1)
    assert index.evict(10).num_blocks == 1  # only the new branch
    index.unlock(node)
    assert (upper.lock_count, node.lock_count, index.root.lock_count) == (0, 0, 0)
    assert index.evict(10).num_blocks == 5


def test_path_from_the_root(policy):
    index = make_index(policy)
    index.insert(RUN[:2], SLOTS[:2], ready=True)
    leaf = index.insert(RUN, SLOTS[2:], ready=True).node
    path_keys, path_slots = index.path(leaf)
    assert path_keys.dtype == KEY_DTYPE
    assert path_keys.tobytes() == RUN.tobytes()
    assert path_slots.tolist() == SLOTS.tolist()
    root_keys, root_slots = index.path(index.root)
    assert root_keys.size == root_slots.size == 0


def stored(event):
    assert isinstance(event, BlockStored)
    parent = None if event.parent is None else key_ids(event.parent)
    return key_ids(event.keys.tobytes()), parent


def removed(event):
    assert isinstance(event, BlockRemoved)
    return key_ids(event.keys.tobytes())


def test_events(policy):
    index = make_index(policy, record_events=True)
    index.insert(RUN[:2], SLOTS[:2], ready=True)
    pending = index.insert(RUN, SLOTS[2:]).node
    assert [stored(e) for e in index.drain_events()] == [([1, 2], None)]
    index.set_ready(pending)
    index.insert(cat(RUN[:1], keys(9)), np.array([9]), ready=True)  # splits [1, 2]
    assert [stored(e) for e in index.drain_events()] == [([3, 4, 5], [2]), ([9], [1])]
    assert index.drain_events() == []

    result = index.evict(2)
    events = index.drain_events()
    evicted = [key_ids(r.key_bytes) for r in result.runs]
    assert [removed(e) for e in events] == evicted
    assert sorted(k for run in evicted for k in run) in ([4, 5], [5, 9])

    locked = index.match(RUN[:1]).node
    index.lock(locked)
    index.clear()
    events = index.drain_events()
    assert all(isinstance(e, BlockRemoved) for e in events)  # key 1 is still there
    index.unlock(locked)
    index.clear()
    events = index.drain_events()
    assert [removed(e) for e in events[:-1]] == [[1]]
    assert isinstance(events[-1], AllBlocksCleared)
    assert index.num_blocks == 0


def test_clear_returns_every_slot(policy):
    index = make_index(policy, record_events=True)
    index.insert(RUN, SLOTS, ready=True)
    index.insert(cat(RUN[:2], keys(9)), np.array([9]), ready=True)
    index.drain_events()
    assert sorted(index.clear().tolist()) == [9, *SLOTS.tolist()]
    events = index.drain_events()
    assert sorted(k for e in events[:-1] for k in removed(e)) == [1, 2, 3, 4, 5, 9]
    assert events[-1] == AllBlocksCleared()


def test_no_events_unless_asked(policy):
    index = make_index(policy)
    index.insert(RUN[:2], SLOTS[:2], ready=True)
    index.set_ready(index.insert(RUN, SLOTS[2:]).node)
    index.evict(1)
    index.clear()
    assert index.drain_events() == []


@pytest.mark.parametrize(
    "bad",
    [
        np.arange(5, dtype=np.uint64),
        RUN.reshape(1, 5),
        [b"\x00" * 16],
        RUN.tobytes(),
        np.zeros(5, dtype=np.dtype((np.void, 8))),
    ],
    ids=["uint64", "2-d", "list", "bytes", "void8"],
)
def test_wrong_key_type(policy, bad):
    index = make_index(policy)
    index.insert(RUN, SLOTS, ready=True)
    before = stats(index)
    with pytest.raises(TypeError):
        index.match(bad)
    with pytest.raises(TypeError):
        index.insert(bad, np.array([1]))
    assert stats(index) == before


def test_remove_drops_a_block_and_everything_below_it(policy):
    index = make_index(policy)
    index.insert(RUN, SLOTS, ready=True)  # 1..5
    index.insert(cat(RUN[:3], keys(7, 8)), np.array([7, 8]), ready=True)
    slots = index.remove(RUN[:3])  # block 3 and below: 3, 4, 5, 7, 8
    assert sorted(slots.tolist()) == [7, 8, 12, 13, 14]
    assert shape(index) == [((1, 2), (10, 11), True)]
    assert index.num_blocks == 2 and index.policy.num_candidates == 1


def test_remove_refuses_locked_in_flight_or_absent_blocks_and_changes_nothing(policy):
    index = make_index(policy)
    index.insert(RUN, SLOTS, ready=True)
    node = index.match(RUN).node
    index.lock(node)
    pending = index.insert(cat(RUN, keys(9)), np.array([9])).node
    before = shape(index), index.num_nodes
    for target in (RUN[:2], RUN, cat(RUN, keys(9)), keys(42), RUN[:0]):
        with pytest.raises(IndexConflict):
            index.remove(target)
    assert (shape(index), index.num_nodes) == before
    index.discard(pending)
    with pytest.raises(IndexConflict):
        index.remove(RUN[:2])  # still locked
    index.unlock(node)
    assert index.remove(RUN[:2]).tolist() == [11, 12, 13, 14]
