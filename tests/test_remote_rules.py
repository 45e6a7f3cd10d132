"""The remote tier's rules in the control plane: the double-get rule, the
in-flight put quota, offline tiers, probe results, skipped writes, backoff."""

from __future__ import annotations

import pytest
from helpers import assert_clean, chain, finish, gpu, make_engine, put_ready

from sidecar.control.admission import DoubleGetRule, PutQuota
from sidecar.control.graph import OpKind
from sidecar.control.plan import PlanError, TierCounts
from sidecar.control.planner import GlobalCacheEngine
from sidecar.tiers.remote.tier import Backoff

H2REMOTE, REMOTE2H = OpKind.H2REMOTE, OpKind.REMOTE2H


def make_global(**kwargs) -> GlobalCacheEngine:
    return GlobalCacheEngine(
        make_engine("cpu", 32), None, make_engine("remote", 64), "write_through", **kwargs
    )


@pytest.mark.parametrize(
    ("missing", "total", "allowed"),
    [(0, 10, False), (3, 10, False), (4, 10, True), (4, 50, False), (5, 50, True), (9, 9, True)],
)
def test_double_get_rule_needs_both_enough_blocks_and_enough_share(missing, total, allowed):
    assert DoubleGetRule(4, 0.1).allows(missing, total) is allowed


def test_put_quota_grants_what_is_left_and_counts_the_rest():
    q = PutQuota(10)
    assert q.admit(6) == 6
    q.hold(1, 0, 6)
    assert q.admit(6) == 4 and (q.denied_blocks, q.denied_puts) == (2, 1)
    q.hold(2, 0, 4)
    assert q.admit(1) == 0 and q.denied_blocks == 3
    q.release_op(1, 0)
    q.release_op(1, 0)  # twice: nothing more comes back
    assert q.in_flight == 4
    q.release_plan(2)
    assert q.in_flight == 0
    with pytest.raises(ValueError):
        PutQuota(-1)


def test_remote_writes_past_the_quota_are_denied_until_the_first_lands():
    g = make_global(remote_quota=6)
    first = g.put(chain(4), gpu(4))
    second = g.put(chain(4, start=50), gpu(4))
    assert [op.num_blocks for op in first.graph.of_kind(H2REMOTE)] == [4]
    assert [op.num_blocks for op in second.graph.of_kind(H2REMOTE)] == [2]
    third = g.put(chain(3, start=90), gpu(3))
    assert not third.graph.of_kind(H2REMOTE)
    assert (g.quota.denied_blocks, g.quota.denied_puts, g.quota.in_flight) == (5, 2, 6)
    finish(g, first)
    assert g.quota.in_flight == 2
    g.cancel(third.plan_id)
    g.cancel(second.plan_id)
    assert g.quota.in_flight == 0
    fourth = g.put(chain(3, start=90), gpu(3))
    assert [op.num_blocks for op in fourth.graph.of_kind(H2REMOTE)] == [3]
    finish(g, fourth)
    assert g.lower["remote"].match(chain(4)).num_blocks == 4
    assert_clean(g)


def test_an_offline_remote_tier_is_neither_read_nor_written():
    g = make_global()
    put_ready(g.lower["remote"], chain(8))
    g.set_online("remote", False)
    assert g.lookup(chain(8)) == TierCounts(0, 0, 0)
    assert g.remote_probe_start(chain(8)) is None
    assert not g.get(chain(8), gpu(8)).graph.ops
    save = g.put(chain(4, start=40), gpu(4))
    assert not save.graph.of_kind(H2REMOTE)
    finish(g, save)
    g.set_online("remote", True)
    assert g.lookup(chain(8)).remote == 8
    with pytest.raises(ValueError):
        g.set_online("ssd", True)
    assert_clean(g)


def test_the_double_get_rule_gates_lookups_loads_and_probes():
    g = make_global(remote_rule=DoubleGetRule(4, 0.5))
    put_ready(g.lower["remote"], chain(8))
    put_ready(g.cpu, chain(5))  # 3 of 8 missing locally: too few
    assert g.lookup(chain(8)).remote == 0
    plan = g.get(chain(8), gpu(8))
    assert not plan.graph.of_kind(REMOTE2H)
    finish(g, plan)
    assert g.remote_probe_start(chain(12)) is None  # 7 of 12 missing but known: 4 unknown
    assert g.remote_probe_start(chain(20)) == 8  # 12 of 20 missing: ask from block 8 on
    g.cpu.remove(chain(1))
    assert g.lookup(chain(8)).remote == 8
    assert_clean(g)


def test_probe_results_join_the_remote_index_ready():
    g = make_global()
    put_ready(g.lower["remote"], chain(2))
    assert g.remote_probe_start(chain(6)) == 2
    assert g.learn_remote(chain(6), 5) == 3
    assert g.lookup(chain(6)).remote == 5
    assert g.learn_remote(chain(6), 4) == 0  # known already
    assert g.learn_remote(chain(6), 0) == 0
    plan = g.get(chain(6), gpu(6))
    assert [op.kind for op in plan.graph.ops] == [REMOTE2H, OpKind.H2D]
    finish(g, plan)
    assert_clean(g)


def test_a_failed_write_is_skipped_and_the_rest_of_its_plan_lands():
    g = make_global()
    plan = g.put(chain(4), gpu(4))
    d2h, h2remote = (op.op_id for op in plan.graph.ops)
    with pytest.raises(PlanError):
        g.skip(plan.plan_id, d2h)  # the remote write depends on it
    assert not g.complete(plan.plan_id, d2h)
    assert g.skip(plan.plan_id, h2remote)
    assert g.lookup(chain(4)) == TierCounts(4, 0, 0)
    assert g.quota is None
    assert_clean(g)


def test_a_skip_refused_before_its_deps_changes_nothing():
    g = make_global()
    plan = g.put(chain(4), gpu(4))
    d2h, h2remote = (op.op_id for op in plan.graph.ops)
    with pytest.raises(PlanError, match="before its deps"):
        g.skip(plan.plan_id, h2remote)  # its D2H has not landed yet
    assert not g.complete(plan.plan_id, d2h)
    assert g.complete(plan.plan_id, h2remote)  # the write lands after all: its blocks count
    assert g.lower["remote"].match(chain(4)).num_blocks == 4  # ready in the remote index
    assert_clean(g)


def test_backoff_doubles_up_to_its_maximum_and_resets():
    b = Backoff(1.0, 5.0)
    assert [b.failed(10.0) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.next_try == 15.0
    b.reset()
    assert b.failed(0.0) == 1.0
