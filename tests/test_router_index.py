"""One scenario suite over every implementation of the router's index."""

from __future__ import annotations

import importlib.util

import pytest

from router.index import (
    INDEXES,
    KeyConflict,
    KvIndex,
    OverlapScores,
    RouterIndexError,
    UnknownBlock,
    UnknownParent,
    make_index,
)
from router.keys import BlockKey, Worker, worker

make_index("radix")  # fills INDEXES
IMPLS = sorted(INDEXES)
W0, W1, W2 = worker(0), worker(1), worker(2)


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def ks(*ids: int) -> list[BlockKey]:
    return [k(i) for i in ids]


def store_chain(idx: KvIndex, w: Worker, ids: list[int], parent: int | None = None) -> None:
    idx.apply_stored(w, ks(*ids), None if parent is None else k(parent))


@pytest.fixture(params=IMPLS)
def idx(request: pytest.FixtureRequest) -> KvIndex:
    return make_index(request.param)


def scores(idx: KvIndex, *ids: int, early_exit: bool = False) -> dict[Worker, int]:
    return idx.find_matches(ks(*ids), early_exit).scores


def test_every_implementation_is_registered() -> None:
    built = importlib.util.find_spec("router._cindex") is not None
    expected = ["flat", "native", "radix"] if built else ["flat", "radix"]  # native: C, optional
    assert expected == IMPLS
    with pytest.raises(ValueError, match="unknown index"):
        make_index("btree")


def test_partial_overlap(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3])
    assert scores(idx, 1, 2, 3, 4, 5) == {W0: 3}
    assert scores(idx, 1, 2) == {W0: 2}
    assert scores(idx, 9, 1) == {}
    assert idx.find_matches(ks(1)) == OverlapScores({W0: 1}, {W0: 3})


def test_shared_prefix_across_workers(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3, 4])
    store_chain(idx, W1, [1, 2])
    store_chain(idx, W1, [30, 40], parent=2)
    assert scores(idx, 1, 2, 3, 4) == {W0: 4, W1: 2}
    assert scores(idx, 1, 2, 30, 40) == {W0: 2, W1: 4}
    assert idx.workers() == {W0: 4, W1: 4}


@pytest.mark.parametrize("at", range(6))
def test_divergence_at_every_position(idx: KvIndex, at: int) -> None:
    base = [1, 2, 3, 4, 5, 6]
    store_chain(idx, W0, base)
    other = base[:at] + [100 + i for i in range(at, 6)]
    if at == 0:
        store_chain(idx, W1, other)
    else:
        store_chain(idx, W1, other[:at])
        store_chain(idx, W1, other[at:], parent=other[at - 1])
    assert scores(idx, *base) == ({W0: 6, W1: at} if at else {W0: 6})
    assert scores(idx, *other) == ({W0: at, W1: 6} if at else {W1: 6})


def test_staggered_workers(idx: KvIndex) -> None:
    chain = list(range(1, 9))
    for n, w in zip((2, 4, 6, 8), (W0, W1, W2, worker(3)), strict=True):
        store_chain(idx, w, chain[:n])
    assert scores(idx, *chain) == {W0: 2, W1: 4, W2: 6, worker(3): 8}
    assert scores(idx, *chain[:5]) == {W0: 2, W1: 4, W2: 5, worker(3): 5}


def test_early_exit_stops_with_one_worker_left(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3, 4])
    store_chain(idx, W1, [1])
    got = scores(idx, 1, 2, 3, 4, early_exit=True)
    assert got[W1] == 1 and 2 <= got[W0] <= 4
    assert scores(idx, 1, 2, 3, 4) == {W0: 4, W1: 1}


def test_dp_ranks_are_distinct_workers(idx: KvIndex) -> None:
    store_chain(idx, worker(5, 0), [1, 2])
    store_chain(idx, worker(5, 1), [1])
    assert scores(idx, 1, 2) == {worker(5, 0): 2, worker(5, 1): 1}


def test_remove_leaf(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3])
    idx.apply_removed(W0, ks(3))
    assert scores(idx, 1, 2, 3) == {W0: 2}
    assert idx.workers() == {W0: 2}
    store_chain(idx, W0, [3], parent=2)
    assert scores(idx, 1, 2, 3) == {W0: 3}


def test_remove_middle_keeps_tail_but_match_stops(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3, 4])
    store_chain(idx, W1, [1, 2, 3, 4])
    idx.apply_removed(W0, ks(2))
    assert scores(idx, 1, 2, 3, 4) == {W0: 1, W1: 4}
    assert idx.workers() == {W0: 3, W1: 4}
    with pytest.raises(UnknownParent):
        store_chain(idx, W0, [9], parent=2)
    store_chain(idx, W0, [2], parent=1)  # the gap refilled: the tail counts again
    assert scores(idx, 1, 2, 3, 4) == {W0: 4, W1: 4}


def test_remove_unknown_block_changes_nothing(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3])
    before = idx.dump()
    with pytest.raises(UnknownBlock, match="does not hold 1 of the 2"):
        idx.apply_removed(W0, ks(3, 7))
    with pytest.raises(UnknownBlock):
        idx.apply_removed(W1, ks(1))
    assert idx.dump() == before


def test_unknown_parent_changes_nothing(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2])
    store_chain(idx, W1, [5])
    before = idx.dump()
    with pytest.raises(UnknownParent):
        store_chain(idx, W0, [3, 4], parent=9)
    with pytest.raises(UnknownParent):  # W1 does not hold 2, though W0 does
        store_chain(idx, W1, [3], parent=2)
    assert idx.dump() == before
    assert isinstance(UnknownParent("x"), RouterIndexError)


def test_key_under_another_parent_is_a_conflict(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3])
    before = idx.dump()
    with pytest.raises(KeyConflict):
        store_chain(idx, W1, [7, 3])
    with pytest.raises(KeyConflict):
        store_chain(idx, W1, [8, 8])
    assert idx.dump() == before


def test_store_is_idempotent(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2])
    store_chain(idx, W0, [1, 2])
    assert idx.workers() == {W0: 2}


def test_clear_and_remove_worker(idx: KvIndex) -> None:
    store_chain(idx, W0, [1, 2, 3])
    store_chain(idx, W1, [1, 2])
    idx.apply_cleared(W0)
    assert scores(idx, 1, 2, 3) == {W1: 2}
    assert idx.workers() == {W0: 0, W1: 2}
    idx.remove_worker(W1.worker_id)
    idx.remove_worker(worker(42).worker_id)
    assert scores(idx, 1, 2, 3) == {}
    assert idx.workers() == {W0: 0}
    assert idx.dump().entries == []


@pytest.mark.parametrize("impl", IMPLS)
def test_dump_restore_round_trip(impl: str) -> None:
    idx = make_index(impl)
    store_chain(idx, W0, [1, 2, 3, 4])
    store_chain(idx, W1, [1, 2, 30])
    idx.apply_removed(W0, ks(2))
    idx.add_worker(W2)
    dump = idx.dump()
    assert dump.workers == (W0, W1, W2)
    seen: set[BlockKey] = set()
    for entry in dump.entries:  # parents first
        assert entry.parent is None or entry.parent in seen
        seen.add(entry.key)
    copy = make_index(impl)
    copy.restore(dump)
    for query in ([1, 2, 3, 4], [1, 2, 30], [2, 3]):
        assert copy.find_matches(ks(*query)) == idx.find_matches(ks(*query))
    assert sorted(copy.dump().entries) == sorted(dump.entries)
    store_chain(copy, W2, [7])
    copy.restore(dump)  # replaces the contents, the block stored since included
    assert sorted(copy.dump().entries) == sorted(dump.entries)


def test_empty_query_and_empty_index(idx: KvIndex) -> None:
    assert idx.find_matches([]) == OverlapScores({}, {})
    assert scores(idx, 1) == {}


def test_an_empty_removal_for_an_unknown_worker_changes_nothing(idx: KvIndex) -> None:
    idx.apply_removed(W1, [])
    assert idx.workers() == {} and idx.dump().workers == ()
    store_chain(idx, W0, [1])
    idx.apply_removed(W0, [])
    assert idx.workers() == {W0: 1}


def test_a_key_under_its_own_descendant_is_a_conflict(idx: KvIndex) -> None:
    """A block removed from the middle of a chain still names that chain's
    prefix: storing it below its own descendant would make a cycle."""
    store_chain(idx, W0, [1, 2])
    idx.apply_removed(W0, ks(1))
    before = idx.dump()
    with pytest.raises(KeyConflict):
        store_chain(idx, W0, [1], parent=2)
    with pytest.raises(KeyConflict):
        store_chain(idx, W0, [2, 1])
    assert idx.dump() == before
    idx.apply_removed(W0, ks(2))  # the hole goes with its last descendant
    assert idx.dump().entries == []
    store_chain(idx, W1, [1], parent=None)
    assert scores(idx, 1) == {W1: 1}


def test_flat_holder_sets_survive_their_caches_starting_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flat index's interned holder sets give the tree's answers when
    their transition caches start over every few stores (equal sets are then
    distinct objects, which a match must still treat as equal)."""
    import random

    import router.flat

    monkeypatch.setattr(router.flat, "MAX_TRANSITIONS", 3)
    flat, tree = make_index("flat"), make_index("radix")
    rng = random.Random(7)
    chains = {w: [] for w in (W0, W1, W2, worker(3, 1))}
    for step in range(300):
        w = rng.choice(list(chains))
        held = chains[w]
        if held and rng.random() < 0.3:
            gone = held[-rng.randint(1, len(held)) :]
            for index in (flat, tree):
                index.apply_removed(w, ks(*gone))
            del held[-len(gone) :]
        elif rng.random() < 0.05:
            for index in (flat, tree):
                index.apply_cleared(w)
            for rank in [r for r in chains if r.worker_id == w.worker_id]:
                chains[rank] = []
        else:
            n = rng.randint(1, 4)
            new = list(range(len(held) + 1, len(held) + 1 + n))
            for index in (flat, tree):
                store_chain(index, w, new, held[-1] if held else None)
            held += new
        if step % 7 == 0:
            flat.sweep(5)
            tree.sweep(5)
        query = ks(*range(1, 12))
        for early in (False, True):
            assert flat.find_matches(query, early) == tree.find_matches(query, early), step
