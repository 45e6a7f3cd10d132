"""DataPlane: a plan given up while one of its sidecar ops runs on a thread
is rolled back only when that op returns; nothing leaks, nothing asserts."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
from helpers import assert_clean, chain, gpu, make_engine, put_ready

from sidecar.control.cache_engine import CacheEngine
from sidecar.control.graph import OpKind, TransferOp
from sidecar.control.node import RadixNode
from sidecar.control.planner import GlobalCacheEngine
from sidecar.tiers.dataplane import DataPlane, Job, split
from sidecar.tiers.io_pool import IoPool

REQUEST = chain(4)


class GatedSsd:
    """An SSD tier whose reads and writes wait for `gate` (real threads, no I/O)."""

    tier = "ssd"
    kinds = frozenset({OpKind.DISK2H, OpKind.H2DISK})

    def __init__(self) -> None:
        self.pool = IoPool("gated", 1)
        self.counters: Counter[str] = Counter()
        self.gate = threading.Event()
        self.started = threading.Event()

    def parts(self, op: TransferOp) -> int:
        return self.pool.threads

    def job(self, op: TransferOp, tier: CacheEngine, node: RadixNode) -> Job:
        def run(lo: int, hi: int) -> None:
            self.started.set()
            assert self.gate.wait(10)

        return run

    def record_failure(self, error: BaseException) -> None:
        self.counters["errors"] += 1

    def drop(self, tier: CacheEngine, prefixes: list) -> None:
        raise AssertionError("no read fails here")


@pytest.fixture
def setup() -> Iterator[tuple[GlobalCacheEngine, DataPlane, GatedSsd, list]]:
    cache = GlobalCacheEngine(make_engine("cpu", 8), make_engine("ssd", 8), None, "write_through")
    ssd = GatedSsd()
    ended: list[tuple[int, bool]] = []
    plane = DataPlane(cache, None, None, [ssd], lambda pid, ok: ended.append((pid, ok)))  # type: ignore[arg-type]
    yield cache, plane, ssd, ended
    ssd.gate.set()
    ssd.pool.close()


def run_until_ended(plane: DataPlane, ssd: GatedSsd, ended: list) -> None:
    for _ in range(100):
        if ended:
            return
        plane.collect(ssd.pool)
        threading.Event().wait(0.01)
    raise AssertionError("the plan never ended")


def test_cancel_while_a_read_runs_rolls_back_after_it(setup):
    cache, plane, ssd, ended = setup
    put_ready(cache.lower["ssd"], REQUEST)
    plan = cache.get(REQUEST, gpu(4))  # DISK2H into staged CPU slots, then H2D
    plane.adopt(plan)
    assert ssd.started.wait(5) and plane.busy(plan.plan_id)
    plane.cancel(plan.plan_id)  # the engine left: its slots are still being read into
    assert cache.num_active_plans == 1, "rolled back under a running thread"
    ssd.gate.set()
    run_until_ended(plane, ssd, ended)
    assert ended == [(plan.plan_id, False)]
    assert not plane.plans
    assert_clean(cache)
    assert cache.lookup(REQUEST).ssd == 4  # the SSD copy is untouched


def test_cancel_of_an_idle_plan_is_immediate(setup):
    cache, plane, _, ended = setup
    plan = cache.put(REQUEST, gpu(4))  # D2H first: its H2DISK waits on the engine
    plane.adopt(plan)
    assert not plane.busy(plan.plan_id)
    plane.cancel(plan.plan_id)
    assert not plane.plans and not ended
    assert_clean(cache)


@pytest.mark.parametrize(
    ("n", "parts", "ranges"),
    [
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (7, 3, [(0, 3), (3, 6), (6, 7)]),
        (2, 4, [(0, 1), (1, 2)]),
        (5, 1, [(0, 5)]),
        (0, 4, []),
    ],
)
def test_split_covers_every_block_once_in_at_most_parts_ranges(n, parts, ranges):
    assert split(n, parts) == ranges
