"""Worker choice (cost, ties, temperature), per-worker stats and the Router API."""

from __future__ import annotations

from collections import Counter

import pytest

from contract.events import Cleared, Removed, Stored
from router.choice import NoWorkers, WorkerSelector
from router.index import OverlapScores
from router.keys import BlockKey, worker
from router.router import Router

W0, W1, W2 = worker(0), worker(1), worker(2)


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def ks(*ids: int) -> list[BlockKey]:
    return [k(i) for i in ids]


def test_cost_without_load_prefers_overlap() -> None:
    sel = WorkerSelector()
    scores = OverlapScores({W0: 2, W1: 6}, {W0: 10, W1: 10, W2: 0})
    choice = sel.select(scores, 8)
    assert choice.worker == W1 and choice.overlap == 6
    assert choice.costs == {W0: 6.0, W1: 2.0, W2: 8.0}


def test_decode_load_outweighs_overlap() -> None:
    scores = OverlapScores({W0: 2, W1: 6}, {W0: 10, W1: 10})
    choice = WorkerSelector().select(scores, 8, loads={W1: 5})
    assert choice.worker == W0 and choice.cost == 6.0
    # A heavier overlap weight makes the prefix win again: 3*6 = 18 > 3*2 + 5 = 11.
    assert WorkerSelector(overlap_weight=3).select(scores, 8, loads={W1: 5}).worker == W1


def test_ties_go_to_fewer_cached_blocks_then_lowest_id() -> None:
    scores = OverlapScores({}, {W0: 9, W1: 3, W2: 3})
    assert WorkerSelector().select(scores, 4).worker == W1
    assert WorkerSelector().select(scores, 4, candidates=[W2, W0]).worker == W2


def test_overlap_longer_than_request_counts_as_whole_request() -> None:
    choice = WorkerSelector().select(OverlapScores({W0: 9}, {W0: 9}), 4)
    assert choice.overlap == 4 and choice.cost == 0


def test_temperature_is_seeded_and_favours_low_cost() -> None:
    scores = OverlapScores({W0: 8}, {W0: 8, W1: 0, W2: 0})

    def picks(seed: int) -> list:
        sel = WorkerSelector(temperature=0.5, seed=seed)
        return [sel.select(scores, 8).worker for _ in range(300)]

    assert picks(7) == picks(7)
    counts = Counter(picks(7))
    assert counts[W0] > counts[W1] and counts[W0] > counts[W2] and len(counts) == 3


def test_bad_parameters_and_no_workers() -> None:
    with pytest.raises(ValueError, match="temperature"):
        WorkerSelector(temperature=-1)
    with pytest.raises(ValueError, match="overlap_weight"):
        WorkerSelector(overlap_weight=float("nan"))
    with pytest.raises(ValueError, match="overlap_weight"):
        WorkerSelector(overlap_weight=1e308)  # costs would overflow to inf
    with pytest.raises(NoWorkers):
        WorkerSelector().select(OverlapScores({}, {}), 3)


@pytest.mark.parametrize("index", ["radix", "flat"])
def test_router_applies_events_routes_and_counts_hits(index: str) -> None:
    router = Router(index, window=2)
    router.apply(W0, [Stored(ks(1, 2, 3), None), Stored(ks(4), k(3))])
    router.apply(W1, [Stored(ks(1), None)])
    assert router.events_applied == 3
    assert router.choose(ks(1, 2, 3, 4, 5)).worker == W0
    assert router.choose(ks(1, 9)).worker == W1  # tie on cost: fewer cached blocks
    router.apply(W0, [Removed(ks(4)), Cleared()])
    assert router.find_matches(ks(1)).scores == {W1: 1}
    for _ in range(3):
        router.choose(ks(1, 2))
    snap = router.stats.snapshot()
    w1 = snap["workers"]["1/0"]  # type: ignore[index]
    assert w1["requests"] == 4 and w1["window_requests"] == 2 and w1["window_hit_ratio"] == 0.5
    router.remove_worker(W1.worker_id)
    assert "1/0" not in router.stats.snapshot()["workers"]  # type: ignore[operator]


def test_router_routes_by_tokens_with_a_hasher() -> None:
    from contract.blocks import KeyHasher, Namespace

    ns = Namespace("m", "r", "layers", "float32", 1, 2, 2, 8, 4)
    router = Router(hasher=KeyHasher(ns))
    keys = router.keys_of_tokens(list(range(10)))
    assert len(keys) == 2
    router.apply(W2, [Stored(keys, None)])
    assert router.choose(router.keys_of_tokens(list(range(12)))).overlap == 2
    with pytest.raises(ValueError, match="no token hasher"):
        Router().keys_of_tokens([1, 2])


def test_candidates_must_be_known_workers() -> None:
    """An unknown id would win every tie (it holds no blocks) and leave a hit
    entry behind for ever."""
    scores = OverlapScores({}, {W0: 9, W1: 3})
    with pytest.raises(ValueError, match="not known"):
        WorkerSelector().select(scores, 4, candidates=[W0, W2])
    with pytest.raises(ValueError, match="empty"):
        WorkerSelector().select(scores, 4, candidates=[])
