"""The router's semantics where they follow NVIDIA Dynamo's KV indexer, and the
lazy removal of workers:

- a worker id is one worker: a clear from any of its data-parallel ranks, or
  removing it, covers every rank (a subscriber resetting one rank's stream
  clears that rank alone);
- `restore` validates the whole dump before touching the index, and a valid
  dump replaces the index's contents (an empty dump empties it);
- requests of zero blocks are not recorded in the sliding hit window;
  negative loads and more hits than requested blocks are refused;
- clearing or removing a worker is O(1): its entries are stale at once (no
  query sees them) and swept in bounded slices; scores are exactly those of
  a reference model whatever the interleaving of sweeps.
"""

from __future__ import annotations

import random
import time

import pytest

from contract.events import Cleared, Stored
from router.dump import DumpEntry, IndexDump
from router.index import INDEXES, KvIndex, RouterIndexError, make_index
from router.keys import BlockKey, Worker, WorkerId, worker
from router.router import Router
from router.serve import RouterServer
from router.stats import RouterStats
from sidecar.control.hits import HitStats
from sidecar.control.plan import TierCounts

make_index("radix")  # fills INDEXES
IMPLS = sorted(INDEXES)
W0, W1 = worker(0), worker(1)
RANKS = [worker(5, r) for r in range(3)]


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def ks(*ids: int) -> list[BlockKey]:
    return [k(i) for i in ids]


@pytest.fixture(params=IMPLS)
def idx(request: pytest.FixtureRequest) -> KvIndex:
    return make_index(request.param)


def with_ranks(idx: KvIndex) -> None:
    for r, w in enumerate(RANKS):
        idx.apply_stored(w, ks(1, 2, 3 + r), None)
    idx.apply_stored(W1, ks(1, 2), None)


# ---- a worker id is all of its data-parallel ranks ---------------------------


def test_a_clear_from_one_rank_clears_every_rank_of_the_worker(idx: KvIndex) -> None:
    with_ranks(idx)
    idx.apply_cleared(RANKS[0])
    assert idx.find_matches(ks(1, 2, 4)).scores == {W1: 2}
    assert idx.workers() == {**dict.fromkeys(RANKS, 0), W1: 2}  # still known


def test_removing_a_worker_id_forgets_every_rank(idx: KvIndex) -> None:
    with_ranks(idx)
    idx.remove_worker(WorkerId(5))
    assert idx.find_matches(ks(1, 2, 5)).scores == {W1: 2}
    assert idx.workers() == {W1: 2}
    assert idx.dump().workers == (W1,)
    idx.remove_worker(WorkerId(42))  # unknown: a no-op


def test_clear_rank_clears_that_rank_alone(idx: KvIndex) -> None:
    with_ranks(idx)
    idx.clear_rank(RANKS[1])
    assert idx.find_matches(ks(1, 2, 3)).scores == {RANKS[0]: 3, RANKS[2]: 2, W1: 2}
    assert idx.workers()[RANKS[1]] == 0


def test_router_cleared_event_and_remove_worker_cover_every_rank() -> None:
    router = Router("flat")
    for r, w in enumerate(RANKS):
        router.apply(w, [Stored(ks(1, 10 + r), None)])
        router.choose(ks(1), candidates=[w])
    router.apply(RANKS[2], [Cleared()])
    assert router.find_matches(ks(1)).scores == {}
    router.remove_worker(WorkerId(5))
    assert router.index.workers() == {}
    assert router.stats.snapshot()["workers"] == {}


# ---- restore validates first, then replaces ----------------------------------


def bad_dumps() -> dict[str, IndexDump]:
    a, b = DumpEntry(k(1), None, (W0,)), DumpEntry(k(2), k(1), (W0,))
    return {
        "child before parent": IndexDump((W0,), [b, a]),
        "unknown parent": IndexDump((W0,), [a, DumpEntry(k(3), k(9), (W0,))]),
        "repeated key": IndexDump((W0,), [a, b, DumpEntry(k(2), k(1), (W1,))]),
        "key is its own parent": IndexDump((W0,), [DumpEntry(k(4), k(4), (W0,))]),
        "held by nobody, nothing below": IndexDump((W0,), [a, DumpEntry(k(2), k(1), ())]),
        "holder not listed": IndexDump((W0,), [a, DumpEntry(k(2), k(1), (W1,))]),
    }


@pytest.mark.parametrize("case", sorted(bad_dumps()))
def test_a_bad_dump_raises_and_changes_nothing(idx: KvIndex, case: str) -> None:
    for blocks in ([], [7, 8]):  # into an empty index, then over held blocks
        if blocks:
            idx.apply_stored(W1, ks(*blocks), None)
        before = idx.dump()
        with pytest.raises(RouterIndexError):
            idx.restore(bad_dumps()[case])
        assert idx.dump() == before
        assert idx.find_matches(ks(1, 2)).scores == {}
        assert idx.find_matches(ks(7, 8)).scores == ({W1: 2} if blocks else {})


def test_a_restore_replaces_the_contents(idx: KvIndex) -> None:
    idx.apply_stored(W1, ks(7, 8), None)
    idx.restore(IndexDump((W0,), [DumpEntry(k(1), None, (W0,)), DumpEntry(k(2), k(1), (W0,))]))
    assert idx.workers() == {W0: 2}
    assert idx.find_matches(ks(7, 8)).scores == {}
    assert idx.find_matches(ks(1, 2)).scores == {W0: 2}


def test_an_empty_dump_means_nothing_is_held(idx: KvIndex) -> None:
    """A dump naming workers but no blocks: those workers are known and hold
    nothing; a dump naming no worker: the index is empty."""
    idx.apply_stored(W0, ks(1, 2), None)
    idx.apply_stored(W1, ks(1), None)
    idx.restore(IndexDump((W0,), []))
    assert idx.workers() == {W0: 0}
    assert idx.find_matches(ks(1, 2)).scores == {}
    idx.restore(IndexDump((), []))
    assert idx.workers() == {} and idx.dump() == IndexDump((), [])


# ---- hit stats and loads ------------------------------------------------------


def test_zero_block_requests_stay_out_of_the_window() -> None:
    stats = RouterStats(window=3)
    stats.record(W0, 4, 4)
    for _ in range(3):
        stats.record(W0, 0, 0)  # prompts shorter than a block
    figures = stats.snapshot()["all"]
    assert figures["window_hit_ratio"] == 1.0  # type: ignore[index]
    assert figures["window_requests"] == 1 and figures["requests"] == 4  # type: ignore[index]


def test_more_hits_than_requested_blocks_are_refused() -> None:
    stats = HitStats(4)
    with pytest.raises(ValueError, match="hit"):
        stats.record(2, TierCounts(2, 1, 0))
    with pytest.raises(ValueError, match="hit"):
        stats.record(2, TierCounts(-1, 0, 0))
    with pytest.raises(ValueError, match="hit"):
        RouterStats(4).record(W0, 1, 2)
    assert stats.requests == 0


def test_choose_refuses_negative_loads() -> None:
    router = Router("radix")
    router.add_worker(W0)
    with pytest.raises(ValueError, match="loads must be >= 0"):
        router.choose(ks(1), loads={W0: -1})
    assert router.stats.total.requests == 0


# ---- lazy removal ---------------------------------------------------------------


def test_a_removed_worker_is_swept_in_bounded_slices(idx: KvIndex) -> None:
    idx.apply_stored(W0, ks(*range(1, 101)), None)
    idx.apply_stored(W1, ks(*range(1, 11)), None)
    idx.remove_worker(W0.worker_id)
    assert idx.stale_blocks == 100
    assert idx.find_matches(ks(*range(1, 101))).scores == {W1: 10}
    assert idx.sweep(30) and idx.stale_blocks == 70
    idx.apply_stored(W0, ks(1, 2), None)  # back, while its old entries are stale
    assert idx.find_matches(ks(1, 2, 3)).scores == {W0: 2, W1: 3}
    while idx.sweep(30):
        pass
    assert idx.stale_blocks == 0
    assert idx.find_matches(ks(1, 2, 3)).scores == {W0: 2, W1: 3}
    assert len(idx.dump().entries) == 10


def test_a_conflict_check_does_not_see_stale_entries(idx: KvIndex) -> None:
    """A key known only through a cleared worker is not known: storing it
    under another parent is no conflict."""
    idx.apply_stored(W0, ks(1, 2), None)
    idx.apply_cleared(W0)
    idx.apply_stored(W1, ks(2, 1), None)
    assert idx.find_matches(ks(2, 1)).scores == {W1: 2}


# Block i's parent in the reference forest: keys are chained like real ones.
FOREST = {i: (None if i % 8 == 0 else i - 1) for i in range(64)}


def chain_to(i: int) -> list[int]:
    out = [i]
    while FOREST[out[-1]] is not None:
        out.append(FOREST[out[-1]])  # type: ignore[arg-type]
    return out[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_scores_match_a_reference_model_under_any_sweeping(idx: KvIndex, seed: int) -> None:
    rng = random.Random(seed)
    workers = [worker(w, r) for w in range(3) for r in range(2)]
    held: dict[Worker, set[int]] = {}
    for _ in range(400):
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.5:
            i = rng.randrange(64)
            path = chain_to(i)
            start = rng.randrange(len(path))
            parent = path[start - 1] if start else None
            if parent is None or parent in held.get(w, ()):
                idx.apply_stored(w, ks(*path[start:]), None if parent is None else k(parent))
                held.setdefault(w, set()).update(path[start:])
        elif op < 0.65 and held.get(w):
            gone = rng.sample(sorted(held[w]), rng.randint(1, len(held[w])))
            idx.apply_removed(w, ks(*gone))
            held[w] -= set(gone)
        elif op < 0.72:
            idx.apply_cleared(w)
            for other in workers:
                if (other.worker_id == w.worker_id and other in held) or other == w:
                    held[other] = set()
        elif op < 0.77:
            idx.clear_rank(w)
            held[w] = set()
        elif op < 0.82:
            idx.remove_worker(w.worker_id)
            held = {o: b for o, b in held.items() if o.worker_id != w.worker_id}
        else:
            idx.sweep(rng.randint(0, 5))
        for q in rng.sample(range(64), 4):
            query = [*chain_to(q), 999]
            expect: dict[Worker, int] = {}
            for o, blocks in held.items():
                n = next((j for j, b in enumerate(query) if b not in blocks), len(query))
                if n:
                    expect[o] = n
            got = idx.find_matches(ks(*query))
            assert got.scores == expect
            assert got.tree_sizes == {o: len(b) for o, b in held.items()}


def test_router_serve_sweeps_between_requests_without_waiting() -> None:
    router = Router("flat")
    router.apply(W0, [Stored(ks(*range(1, 2501)), None)])
    router.remove_worker(W0.worker_id)
    server = RouterServer(router, "tcp://127.0.0.1:*", [])
    try:
        for _ in range(3):  # 2,500 stale entries: three slices of SWEEP_SLICE
            t0 = time.monotonic()
            server.poll_once(timeout_ms=60_000)
            assert time.monotonic() - t0 < 30  # did not wait for a request
        assert router.index.stale_blocks == 0
    finally:
        server.close()
