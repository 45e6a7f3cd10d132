"""GlobalCacheEngine: the exact plans of GET and PUT, completion, rollback, write policies."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_clean,
    chain,
    finish,
    gpu,
    key_ids,
    make_engine,
    op_rows,
    put_ready,
    tiers,
    walk,
)

from sidecar.control.admission import DoubleGetRule
from sidecar.control.graph import OpKind
from sidecar.control.index import IndexConflict
from sidecar.control.plan import PlanError, PlanKind, TierCounts
from sidecar.control.planner import GlobalCacheEngine

H2D, D2H = OpKind.H2D, OpKind.D2H
DISK2H, H2DISK = OpKind.DISK2H, OpKind.H2DISK
REMOTE2H, H2REMOTE = OpKind.REMOTE2H, OpKind.H2REMOTE

REQUEST = chain(8)  # ids 1..8
GPU = gpu(8)  # GPU block of block i is 100 + i
# Each tier first holds an unrelated run, so a tier's slot for block i is
# OFFSET + i and slots of different tiers differ.
OFFSET = {"cpu": 1, "ssd": 3, "remote": 5}


def make_global(names=("ssd", "remote"), write_policy="write_through", sizes=None, **kwargs):
    sizes = {"cpu": 16, "ssd": 32, "remote": 32, **(sizes or {})}
    engines = {name: make_engine(name, sizes[name]) for name in ("cpu", *names)}
    return GlobalCacheEngine(
        engines["cpu"],
        engines.get("ssd"),
        engines.get("remote"),
        write_policy,
        **kwargs,
    )


def populate(g: GlobalCacheEngine, held: dict[str, int]) -> None:
    """Each tier: its unrelated run, then the first held[name] blocks of REQUEST."""
    for engine in tiers(g):
        put_ready(engine, chain(OFFSET[engine.name], high=9))
        if held.get(engine.name):
            put_ready(engine, REQUEST[: held[engine.name]])


def slots(tier: str, lo: int, hi: int) -> list[int]:
    return [OFFSET[tier] + i for i in range(lo, hi)]


def gpus(lo: int, hi: int) -> list[int]:
    return [100 + i for i in range(lo, hi)]


def expected_get(held: dict[str, int], names, skip: int):
    """The plan GET must make: (rows, hit counts)."""
    c = held.get("cpu", 0)
    rows = []
    hits = {"cpu": max(0, c - skip)}
    if skip < c:
        rows.append((H2D, slots("cpu", skip, c), gpus(skip, c), ()))
    end = c
    for name in names:  # SSD before remote
        if held.get(name, 0) <= end:
            continue
        start, end = end, held[name]
        load = len(rows)
        kind = DISK2H if name == "ssd" else REMOTE2H
        rows.append((kind, slots(name, start, end), slots("cpu", start, end), ()))
        lo = max(start, skip)
        if lo < end:
            rows.append((H2D, slots("cpu", lo, end), gpus(lo, end), (load,)))
        hits[name] = max(0, end - lo)
    return rows, TierCounts(hits["cpu"], hits.get("ssd", 0), hits.get("remote", 0)), end


def fragment_cases():
    for names in [(), ("ssd",), ("remote",), ("ssd", "remote")]:
        for cpu in (0, 2):
            for ssd in (0, 4) if "ssd" in names else (0,):
                for remote in (0, 3, 6) if "remote" in names else (0,):
                    held = {"cpu": cpu, "ssd": ssd, "remote": remote}
                    label = "+".join(("cpu", *names)) + f"-c{cpu}-s{ssd}-r{remote}"
                    yield pytest.param(names, held, id=label)


# ---- GET -----------------------------------------------------------------------


@pytest.mark.parametrize("skip", [0, 1, 3])
@pytest.mark.parametrize(("names", "held"), list(fragment_cases()))
def test_get_plan_shape_for_every_fragment_combination(names, held, skip):
    g = make_global(names)
    populate(g, held)
    rows, hits, end = expected_get(held, names, skip)
    plan = g.get(REQUEST, GPU, skip)
    assert plan.kind is PlanKind.GET
    assert op_rows(plan) == rows
    assert plan.hit_blocks == hits
    assert plan.finished_on_return == (not rows)
    assert g.num_active_plans == (1 if rows else 0)
    finish(g, plan)
    assert g.lookup(REQUEST).cpu == end
    assert_clean(g)


def test_get_with_skip_past_the_cached_prefix_still_stages():
    g = make_global()
    populate(g, {"cpu": 2, "ssd": 4, "remote": 6})
    plan = g.get(REQUEST, GPU, skip=5)
    assert op_rows(plan) == [
        (DISK2H, slots("ssd", 2, 4), slots("cpu", 2, 4), ()),
        (REMOTE2H, slots("remote", 4, 6), slots("cpu", 4, 6), ()),
        (H2D, slots("cpu", 5, 6), gpus(5, 6), (1,)),
    ]
    assert plan.hit_blocks == TierCounts(0, 0, 1)
    finish(g, plan)
    assert_clean(g)


def test_get_skip_bounds():
    g = make_global()
    populate(g, {"cpu": 2})
    assert g.get(REQUEST, GPU, skip=8).finished_on_return
    assert g.get(chain(0), gpu(0)).finished_on_return
    assert_clean(g)


def test_staged_node_is_unready_until_its_loads_complete():
    g = make_global()
    populate(g, {"cpu": 2, "ssd": 4, "remote": 6})
    first = g.get(REQUEST, GPU)
    assert [op.kind for op in first.graph.ops] == [H2D, DISK2H, H2D, REMOTE2H, H2D]
    staged = g.cpu.match(REQUEST).pending
    assert staged is not None and not staged.ready
    # A concurrent GET sees only the ready CPU prefix and stages nothing.
    second = g.get(REQUEST, GPU)
    assert op_rows(second) == [(H2D, slots("cpu", 0, 2), gpus(0, 2), ())]
    assert second.hit_blocks == TierCounts(2, 0, 0)

    pid = first.plan_id
    assert g.complete(pid, 0) is False
    before = g.lookup(REQUEST)
    with pytest.raises(PlanError):
        g.complete(pid, 2)  # H2D before its DISK2H
    assert not staged.ready and g.lookup(REQUEST) == before
    assert g.complete(pid, 1) is False
    assert not staged.ready  # the REMOTE2H part has not landed yet
    assert g.complete(pid, 3) is False
    assert staged.ready
    assert g.lookup(REQUEST).cpu == 6
    with pytest.raises(PlanError):
        g.complete(pid, 1)  # twice
    assert g.complete(pid, 2) is False
    assert g.complete(pid, 4) is True
    with pytest.raises(PlanError):
        g.complete(pid, 4)  # the plan is gone
    finish(g, second)
    assert_clean(g)
    # Now the whole prefix loads from the CPU.
    third = g.get(REQUEST, GPU)
    assert op_rows(third) == [(H2D, slots("cpu", 0, 6), gpus(0, 6), ())]
    finish(g, third)


def test_a_staging_cut_in_parts_makes_each_part_ready_once_it_and_those_before_landed():
    g = make_global()
    populate(g, {"cpu": 1, "ssd": 5, "remote": 8})
    stage = g.get(REQUEST, GPU, skip=8, hit=False, ready_at=[3, 6])  # a load's 1st part: [0, 3)
    # One load op a part and tier: SSD [1, 3) [3, 5); remote [5, 6) [6, 8).
    assert op_rows(stage) == [
        (DISK2H, slots("ssd", 1, 3), slots("cpu", 1, 3), ()),
        (DISK2H, slots("ssd", 3, 5), slots("cpu", 3, 5), ()),
        (REMOTE2H, slots("remote", 5, 6), slots("cpu", 5, 6), ()),
        (REMOTE2H, slots("remote", 6, 8), slots("cpu", 6, 8), ()),
    ]
    pid = stage.plan_id
    g.complete(pid, 1)  # the second part's SSD blocks land first: nothing ready yet
    assert g.lookup(REQUEST).cpu == 1
    g.complete(pid, 0)
    assert g.lookup(REQUEST).cpu == 3  # the first part
    g.complete(pid, 3)  # the third part, before the rest of the second
    assert g.lookup(REQUEST).cpu == 3
    g.complete(pid, 2)
    assert g.lookup(REQUEST).cpu == 8
    assert g.num_active_plans == 0
    plan = g.get(REQUEST, GPU)
    assert op_rows(plan) == [(H2D, slots("cpu", 0, 8), gpus(0, 8), ())]
    finish(g, plan)
    assert_clean(g)


def test_a_staging_in_parts_that_fails_keeps_the_parts_that_landed():
    g = make_global()
    populate(g, {"cpu": 1, "ssd": 8})
    free = g.cpu.mempool.num_free
    stage = g.get(REQUEST, GPU, skip=8, hit=False, ready_at=[3, 5, 7])
    for op_id in (0, 1):
        g.complete(stage.plan_id, op_id)
    assert g.lookup(REQUEST).cpu == 5
    g.fail(stage.plan_id, 2)  # [5, 7) fails: [7, 8) never lands either
    assert g.lookup(REQUEST).cpu == 5
    assert g.cpu.mempool.num_free == free - 4  # the 3 blocks past the parts went back
    assert_clean(g)


def test_a_staging_under_way_is_waited_for_even_where_the_double_get_rule_says_no():
    g = make_global(names=("remote",), remote_rule=DoubleGetRule(4, 0.0))
    populate(g, {"remote": 8})
    stage = g.get(REQUEST, GPU, skip=8, hit=False, ready_at=[5])
    assert g.filling_from_below(REQUEST) and g.lookup(REQUEST).cpu == 0
    g.complete(stage.plan_id, 0)  # the first part: blocks 0-4
    # 3 blocks missing from the CPU tier: too few to ask the remote store for...
    assert g.lookup(REQUEST) == TierCounts(5, 0, 0)
    # ...but they are on their way already: a load of them waits.
    assert g.filling_from_below(REQUEST) and not g.filling_from_below(REQUEST[:5])
    g.complete(stage.plan_id, 1)
    assert not g.filling_from_below(REQUEST) and g.lookup(REQUEST).cpu == 8
    # A save filling blocks no lower tier holds is not waited for.
    other = chain(4, start=50, high=7)
    save = g.put(other, gpu(4))
    assert not g.filling_from_below(other)
    finish(g, save)
    assert_clean(g)


def test_a_part_copies_its_own_blocks_and_keeps_the_staged_blocks_after_it():
    """A part of a load in parts (`end`) copies and counts keys[skip:end],
    but locks the whole CPU prefix: a save evicting for room while the part
    is open cannot take the staged blocks of the parts not yet asked."""
    g = make_global()
    populate(g, {"cpu": 8})
    part = g.get(REQUEST, GPU, 2, stage=False, hit=False, end=5)
    assert op_rows(part) == [(H2D, slots("cpu", 2, 5), gpus(2, 5), ())]
    assert part.hit_blocks == TierCounts(3, 0, 0)
    g.cpu.evict(8)
    assert g.lookup(REQUEST).cpu == 8  # all 8 locked, blocks 5-7 included
    finish(g, part)
    g.cpu.evict(8)
    assert g.lookup(REQUEST).cpu == 0
    with pytest.raises(ValueError):
        g.get(REQUEST, GPU, 2, stage=False, end=1)  # before skip
    with pytest.raises(ValueError):
        g.get(REQUEST, GPU, 2, end=5)  # a part never stages
    assert_clean(g)


def test_cuts_outside_the_staged_blocks_change_nothing():
    g = make_global()
    populate(g, {"cpu": 2, "ssd": 4})
    plan = g.get(REQUEST, GPU, skip=8, hit=False, ready_at=[1, 2, 4, 9])
    assert op_rows(plan) == [(DISK2H, slots("ssd", 2, 4), slots("cpu", 2, 4), ())]
    finish(g, plan)
    assert g.lookup(REQUEST).cpu == 4
    assert_clean(g)


def test_unknown_plan_and_op_ids():
    g = make_global()
    populate(g, {"cpu": 2})
    plan = g.get(REQUEST, GPU)
    for call in (g.complete, g.fail):
        with pytest.raises(PlanError):
            call(plan.plan_id + 100, 0)
    with pytest.raises(PlanError):
        g.cancel(plan.plan_id + 100)
    for op_id in (-1, 1, 50):
        with pytest.raises(PlanError):
            g.complete(plan.plan_id, op_id)
        with pytest.raises(PlanError):
            g.fail(plan.plan_id, op_id)
    assert g.num_active_plans == 1
    assert g.complete(plan.plan_id, 0) is True
    assert_clean(g)


# ---- rollback ----------------------------------------------------------------


@pytest.mark.parametrize(
    "how",
    ["fail-first-load", "fail-after-one-load", "fail-h2d", "cancel", "cancel-after-loads"],
)
def test_get_rollback_leaks_nothing(how):
    g = make_global()
    populate(g, {"cpu": 2, "ssd": 4, "remote": 6})
    before = g.lookup(REQUEST)
    plan = g.get(REQUEST, GPU)
    pid = plan.plan_id
    landed = False
    if how == "fail-first-load":
        g.fail(pid, 1)
    elif how == "fail-after-one-load":
        g.complete(pid, 1)
        g.fail(pid, 3)
    elif how == "fail-h2d":
        g.complete(pid, 1)
        g.complete(pid, 3)
        g.fail(pid, 4)
        landed = True
    elif how == "cancel":
        g.cancel(pid)
    else:
        g.complete(pid, 1)
        g.complete(pid, 3)
        g.cancel(pid)
        landed = True
    assert g.num_active_plans == 0
    with pytest.raises(PlanError):
        g.complete(pid, 0)
    assert_clean(g)
    # Blocks whose loads all landed stay; anything half-loaded is gone.
    assert g.lookup(REQUEST) == (before._replace(cpu=6) if landed else before)


def test_fail_of_a_done_op_is_refused():
    g = make_global()
    populate(g, {"cpu": 2, "ssd": 4})
    plan = g.get(REQUEST, GPU)
    g.complete(plan.plan_id, 1)
    with pytest.raises(PlanError):
        g.fail(plan.plan_id, 1)
    assert g.num_active_plans == 1
    finish_rest(g, plan, done={1})
    assert_clean(g)


def finish_rest(g, plan, done):
    for op in plan.graph.ops:
        if op.op_id not in done:
            g.complete(plan.plan_id, op.op_id)


@pytest.mark.parametrize("how", ["fail-d2h", "fail-h2disk", "cancel"])
def test_put_rollback_leaks_nothing(how):
    g = make_global()
    populate(g, {})
    plan = g.put(REQUEST[:4], GPU[:4])
    pid = plan.plan_id
    if how == "fail-d2h":
        g.fail(pid, 0)
    elif how == "fail-h2disk":
        g.complete(pid, 0)
        g.fail(pid, 1)
    else:
        g.cancel(pid)
    assert_clean(g)
    cpu = 4 if how == "fail-h2disk" else 0
    assert g.lookup(REQUEST) == TierCounts(cpu, 0, 0)


# ---- PUT -----------------------------------------------------------------------


def test_put_skips_what_the_cpu_has():
    g = make_global(())
    populate(g, {"cpu": 2})
    plan = g.put(REQUEST, GPU)
    assert plan.kind is PlanKind.PUT
    assert (plan.skipped_blocks, plan.stored_blocks) == (2, 6)
    assert op_rows(plan) == [(D2H, gpus(2, 8), slots("cpu", 2, 8), ())]
    node = g.cpu.match(REQUEST).pending
    assert node is not None and not node.ready
    assert g.complete(plan.plan_id, 0) is True
    assert g.lookup(REQUEST).cpu == 8
    assert_clean(g)
    again = g.put(REQUEST, GPU)
    assert again.finished_on_return and again.stored_blocks == 0
    assert again.skipped_blocks == 8


def test_put_stores_the_longest_prefix_that_fits_when_the_rest_is_locked():
    g = make_global((), sizes={"cpu": 4})
    other = chain(2, start=50)
    put_ready(g.cpu, other)
    reader = g.get(other, gpu(2))  # holds a lock on `other`
    assert not reader.finished_on_return
    plan = g.put(REQUEST, GPU)
    assert (plan.skipped_blocks, plan.stored_blocks) == (0, 2)
    assert op_rows(plan) == [(D2H, gpus(0, 2), [2, 3], ())]
    finish(g, plan)
    finish(g, reader)
    assert g.lookup(REQUEST).cpu == 2
    assert g.lookup(other).cpu == 2
    assert_clean(g)


def test_put_with_the_whole_tier_locked_stores_nothing():
    g = make_global((), sizes={"cpu": 2})
    other = chain(2, start=50)
    put_ready(g.cpu, other)
    reader = g.get(other, gpu(2))
    plan = g.put(REQUEST, GPU)
    assert plan.finished_on_return and plan.stored_blocks == 0
    finish(g, reader)
    assert_clean(g)


def test_concurrent_put_of_the_same_prefix_stores_it_once():
    g = make_global()
    populate(g, {})
    first = g.put(REQUEST[:4], GPU[:4])
    second = g.put(REQUEST[:4], gpu(4, base=200))
    assert second.finished_on_return
    assert (second.skipped_blocks, second.stored_blocks) == (0, 0)
    longer = g.put(REQUEST, GPU)  # blocks 0..3 in flight: left to the first put
    assert longer.finished_on_return and longer.stored_blocks == 0
    finish(g, first)
    assert g.lookup(REQUEST) == TierCounts(4, 4, 4)
    for engine in tiers(g):
        assert engine.index.num_blocks == OFFSET[engine.name] + 4
    assert_clean(g)


def test_write_through_lands_on_every_lower_tier():
    g = make_global()
    populate(g, {"cpu": 2})
    plan = g.put(REQUEST[:4], GPU[:4])
    assert op_rows(plan) == [
        (D2H, gpus(2, 4), slots("cpu", 2, 4), ()),
        (H2DISK, slots("cpu", 0, 4), slots("ssd", 0, 4), (0,)),
        (H2REMOTE, slots("cpu", 0, 4), slots("remote", 0, 4), (0,)),
    ]
    with pytest.raises(PlanError):
        g.complete(plan.plan_id, 1)  # H2DISK before D2H
    finish(g, plan)
    assert g.lookup(REQUEST) == TierCounts(4, 4, 4)
    assert_clean(g)


def test_write_through_of_blocks_already_on_cpu_has_no_dependency():
    g = make_global()
    populate(g, {"cpu": 4, "ssd": 2})
    plan = g.put(REQUEST[:4], GPU[:4])
    assert (plan.skipped_blocks, plan.stored_blocks) == (4, 0)
    assert op_rows(plan) == [
        (H2DISK, slots("cpu", 2, 4), slots("ssd", 2, 4), ()),
        (H2REMOTE, slots("cpu", 0, 4), slots("remote", 0, 4), ()),
    ]
    finish(g, plan)
    assert g.lookup(REQUEST) == TierCounts(4, 4, 4)
    assert_clean(g)


def test_write_through_selective_writes_down_after_n_hits():
    g = make_global(("ssd",), "write_through_selective", write_through_min_hits=3)
    populate(g, {})
    put = g.put(REQUEST[:4], GPU[:4])
    assert [op.kind for op in put.graph.ops] == [D2H]
    finish(g, put)
    for _ in range(2):
        plan = g.get(REQUEST[:4], GPU[:4])
        assert [op.kind for op in plan.graph.ops] == [H2D]
        finish(g, plan)
    assert g.lookup(REQUEST).ssd == 0
    plan = g.get(REQUEST[:4], GPU[:4])
    assert op_rows(plan) == [
        (H2D, slots("cpu", 0, 4), gpus(0, 4), ()),
        (H2DISK, slots("cpu", 0, 4), slots("ssd", 0, 4), ()),
    ]
    finish(g, plan)
    assert g.lookup(REQUEST).ssd == 4
    plan = g.get(REQUEST[:4], GPU[:4])
    assert [op.kind for op in plan.graph.ops] == [H2D]
    finish(g, plan)
    assert_clean(g)


def test_a_staging_pass_is_not_a_hit():
    # The sidecar stages lower-tier blocks with get(skip=len(keys), hit=False)
    # before the GET itself: only the GET counts, so N loads are N hits.
    g = make_global(("ssd",), "write_through_selective", write_through_min_hits=2)
    populate(g, {})
    finish(g, g.put(REQUEST[:4], GPU[:4]))
    node = g.cpu.match(REQUEST[:4]).node
    for _ in range(3):
        stage = g.get(REQUEST[:4], GPU[:4], 4, hit=False)
        assert stage.finished_on_return  # no write-down planned either
    assert node.hit_count == 0
    finish(g, g.get(REQUEST[:4], GPU[:4]))
    assert node.hit_count == 1 and g.lookup(REQUEST).ssd == 0
    plan = g.get(REQUEST[:4], GPU[:4])
    assert [op.kind for op in plan.graph.ops] == [H2D, H2DISK]  # the second hit
    finish(g, plan)
    assert_clean(g)


def test_write_through_selective_writes_only_the_hot_prefix():
    g = make_global(("ssd",), "write_through_selective", write_through_min_hits=2)
    populate(g, {})
    finish(g, g.put(REQUEST[:2], GPU[:2]))
    finish(g, g.put(REQUEST[:4], GPU[:4]))
    finish(g, g.get(REQUEST[:2], GPU[:2]))  # blocks 0..1: one hit
    plan = g.get(REQUEST[:4], GPU[:4])  # blocks 0..1: two hits, 2..3: one
    assert op_rows(plan)[1:] == [(H2DISK, slots("cpu", 0, 2), slots("ssd", 0, 2), ())]
    finish(g, plan)
    assert g.lookup(REQUEST).ssd == 2
    assert_clean(g)


def test_planner_config_errors():
    with pytest.raises(ValueError):
        make_global(write_policy="write_sometimes")
    with pytest.raises(ValueError):
        make_global(write_policy="write_through_selective", write_through_min_hits=0)


# ---- write-back ------------------------------------------------------------------


@pytest.mark.parametrize("ssd_has", [0, 2])
def test_write_back_writes_evicted_blocks_and_missing_ancestors(ssd_has):
    g = make_global(("ssd",), "write_back", sizes={"cpu": 6})
    if ssd_has:
        put_ready(g.lower["ssd"], REQUEST[:ssd_has])
    ssd = g.lower["ssd"]
    put = g.put(REQUEST[:4], GPU[:4])  # CPU slots 0..3
    assert [op.kind for op in put.graph.ops] == [D2H]
    finish(g, put)
    assert ssd.match(REQUEST).num_blocks == ssd_has
    assert g.drain_background() == []

    # 4 used + 4 asked of 6: the LRU tail (blocks 2, 3) is evicted.
    other = chain(4, start=50)
    plan = g.put(other, gpu(4))
    assert plan.stored_blocks == 2 and op_rows(plan) == [(D2H, gpus(0, 2), [4, 5], ())]
    background = g.drain_background()
    assert len(background) == 1 and background[0].kind is PlanKind.WRITE_BACK
    write = background[0]
    assert op_rows(write) == [(H2DISK, list(range(ssd_has, 4)), list(range(ssd_has, 4)), ())]
    assert g.drain_background() == []
    assert g.cpu.match(REQUEST).num_blocks == 2
    # The evicted slots stay out of the free pool until the write lands.
    assert not g.cpu.mempool.is_free(2) and not g.cpu.mempool.is_free(3)
    finish(g, plan)
    assert g.cpu.mempool.num_used == g.cpu.index.num_blocks + 2
    g.complete(write.plan_id, 0)
    assert g.cpu.mempool.is_free(2) and g.cpu.mempool.is_free(3)
    assert_clean(g)
    assert g.lookup(REQUEST) == TierCounts(2, 4, 0)

    get = g.get(REQUEST[:4], GPU[:4])
    assert op_rows(get) == [
        (H2D, [0, 1], gpus(0, 2), ()),
        (DISK2H, [2, 3], [2, 3], ()),
        (H2D, [2, 3], gpus(2, 4), (1,)),
    ]
    finish(g, get)
    assert_clean(g)


def test_write_back_failure_frees_the_kept_slots():
    g = make_global(("ssd",), "write_back", sizes={"cpu": 4})
    finish(g, g.put(REQUEST[:4], GPU[:4]))
    g.put(chain(2, start=50), gpu(2))
    (write,) = g.drain_background()
    g.fail(write.plan_id, 0)
    assert_clean(g)
    assert g.lookup(REQUEST) == TierCounts(2, 0, 0)


def test_write_back_puts_nothing_on_ssd_without_eviction():
    g = make_global(("ssd", "remote"), "write_back")
    populate(g, {})
    plan = g.put(REQUEST, GPU)
    assert [op.kind for op in plan.graph.ops] == [D2H]
    finish(g, plan)
    assert g.lookup(REQUEST) == TierCounts(8, 0, 0)
    assert g.drain_background() == []


def test_write_back_of_a_parent_evicted_with_its_child_keeps_the_chain():
    """One eviction takes a leaf and then its parent: both runs must reach the
    SSD under their real prefix, so the whole chain loads back from the SSD."""
    g = make_global(("ssd",), "write_back", sizes={"cpu": 4})
    finish(g, g.put(REQUEST[:2], GPU[:2]))
    finish(g, g.put(REQUEST[:4], GPU[:4]))  # CPU: [1, 2] -> [3, 4]
    put = g.put(chain(4, start=50), gpu(4))  # evicts [3, 4], then [1, 2]
    background = g.drain_background()
    # While a write is in flight, no CPU slot it reads may be free or reused.
    reused = set(put.graph.ops[0].dst.tolist()) if put.graph.ops else set()
    for plan in background:
        for op in plan.graph.of_kind(H2DISK):
            assert not any(g.cpu.mempool.is_free(s) for s in op.src.tolist())
            assert not set(op.src.tolist()) & reused
    for plan in (*background, put):
        finish(g, plan)
    ssd = g.lower["ssd"]
    assert ssd.index.num_blocks == 4
    assert ssd.match(REQUEST[:4]).num_blocks == 4
    for node in walk(ssd.index.root):
        path_keys, _ = ssd.index.path(node)
        assert key_ids(path_keys.tobytes()) == list(range(1, len(path_keys) + 1))
    assert_clean(g)


def test_get_never_loads_from_ssd_slots_its_own_allocation_evicted():
    """The CPU allocation of a GET may evict CPU blocks; under write-back that
    writes them to the SSD, which may evict what the GET is about to load.
    Every DISK2H must read SSD slots that still hold the blocks it loads."""
    cpu = make_engine("cpu", 8, evict_start_threshold=0.5)
    ssd = make_engine("ssd", 4)
    g = GlobalCacheEngine(cpu, ssd, None, "write_back")
    wanted, resident = chain(4), chain(4, start=50)
    put_ready(ssd, wanted)
    put_ready(cpu, resident)  # CPU at the 0.5 threshold: the next allocation evicts
    plan = g.get(wanted, gpu(4))
    background = g.drain_background()
    for op in plan.graph.of_kind(DISK2H):
        m = ssd.match(wanted)
        assert m.num_blocks >= op.num_blocks, "the loaded blocks left the SSD index"
        assert op.src.tolist() == m.slots[: op.num_blocks].tolist()
        for write in background:
            for w in write.graph.of_kind(H2DISK):
                assert not set(w.dst.tolist()) & set(op.src.tolist())
    for p in (plan, *background):
        finish(g, p)
    assert_clean(g)


# ---- bad input ---------------------------------------------------------------------


def state(g: GlobalCacheEngine):
    return (
        g.num_active_plans,
        [
            (
                e.mempool.num_free,
                [(n.key_bytes, n.hit_count, n.lock_count, n.ready) for n in walk(e.index.root)],
            )
            for e in tiers(g)
        ],
    )


BAD_REQUESTS = {
    "keys uint64": (np.arange(8, dtype=np.uint64), GPU, TypeError),
    "keys 2-d": (REQUEST.reshape(2, 4), GPU, TypeError),
    "keys list": (list(REQUEST), GPU, TypeError),
    "gpu short": (REQUEST, GPU[:7], ValueError),
    "gpu long": (REQUEST, gpu(9), ValueError),
    "gpu float": (REQUEST, GPU.astype(np.float64), TypeError),
    "gpu 2-d": (REQUEST, GPU.reshape(2, 4), TypeError),
    "gpu negative": (REQUEST, np.array([0, 1, 2, -3, 4, 5, 6, 7]), ValueError),
}


@pytest.mark.parametrize("call", ["get", "put"])
@pytest.mark.parametrize(("keys", "blocks", "error"), BAD_REQUESTS.values(), ids=BAD_REQUESTS)
def test_bad_requests_change_nothing(call, keys, blocks, error):
    g = make_global()
    populate(g, {"cpu": 2, "ssd": 4, "remote": 6})
    last = g.get(REQUEST[:1], GPU[:1])
    finish(g, last)
    before = state(g)
    with pytest.raises(error):
        getattr(g, call)(keys, blocks)
    assert state(g) == before
    assert g.get(chain(0), gpu(0)).plan_id == last.plan_id + 1


@pytest.mark.parametrize("skip", [-1, 9, 100])
def test_skip_out_of_range_changes_nothing(skip):
    g = make_global()
    populate(g, {"cpu": 2, "ssd": 4})
    before = state(g)
    with pytest.raises(ValueError):
        g.get(REQUEST, GPU, skip)
    assert state(g) == before


def test_delete_drops_the_blocks_from_every_tier_holding_them():
    g = make_global(("ssd",), "write_through")
    finish(g, g.put(REQUEST[:6], GPU[:6]))
    assert g.lookup(REQUEST[:6]) == TierCounts(6, 6, 0)
    assert g.delete(REQUEST[:4]) == 2 * 3  # blocks 4..6, from CPU and SSD
    assert g.lookup(REQUEST[:6]) == TierCounts(3, 3, 0)
    assert g.delete(REQUEST[:5]) == 0  # no longer held anywhere
    assert_clean(g)


@pytest.mark.parametrize("upto", [3, 1], ids=["the-whole-save", "its-first-block"])
def test_delete_of_blocks_still_being_saved_raises_and_changes_nothing(upto):
    """An invalidation racing a save must not report success and then see
    the blocks land: they are busy until the save ends."""
    g = make_global((), "write_through")
    save = g.put(REQUEST[:3], GPU[:3])  # the engine has not reported its copy yet
    before = state(g)
    with pytest.raises(IndexConflict):
        g.delete(REQUEST[:upto])
    assert state(g) == before
    finish(g, save)
    assert g.delete(REQUEST[:upto]) == 4 - upto
    assert_clean(g)


def test_delete_of_blocks_in_use_raises_and_changes_nothing():
    g = make_global(("ssd",), "write_through")
    finish(g, g.put(REQUEST[:4], GPU[:4]))
    load = g.get(REQUEST[:4], GPU[:4])  # locks the CPU blocks until it ends
    before = state(g)
    with pytest.raises(IndexConflict):
        g.delete(REQUEST[:2])
    assert state(g) == before
    finish(g, load)
    assert g.delete(REQUEST[:2]) == 2 * 3
    assert_clean(g)
