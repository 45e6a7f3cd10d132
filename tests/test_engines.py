"""sidecar.server.sessions.Engines on its own: which ranks may still write into a
save plan's CPU slots when a rank gives the plan up, and that those slots
stay out of reuse until the writers stop, however late the plan's rollback
frees them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from contract.protocol import KVLayoutMsg
from sidecar.control.graph import OpKind, TransferGraph
from sidecar.control.mempool import Mempool
from sidecar.control.plan import Plan, PlanKind
from sidecar.server.sessions import Engines, Session, namespace_of

SLOTS = np.array([4, 5, 6])


def layout(rank: int, tp_size: int = 2) -> KVLayoutMsg:
    return KVLayoutMsg(
        model_name="m",
        model_revision="r",
        layout="paged",
        dtype="float16",
        tp_size=tp_size,
        tp_rank=rank,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=16,
        layer_block_bytes=1024,
        num_gpu_blocks=8,
    )


class Sidecar:
    """The callbacks a server gives Engines, over a real Mempool; a
    rollback runs at once or, like a plan with an SSD write on an I/O
    thread, only when `finish_rollbacks` is called."""

    def __init__(self, deferred: bool) -> None:
        self.pool = Mempool(8)
        self.pool.allocate(8)  # slots 4-6 are the plan's; the rest other blocks'
        self.deferred = deferred
        self.pending: list[int] = []
        self.engines = Engines(
            self.cancel,
            lambda _group, slots: self.pool.hold(slots),
            lambda _group, slots: self.pool.release(slots),
        )

    def cancel(self, _group: object, plan_id: int) -> None:
        self.pending.append(plan_id)
        if not self.deferred:
            self.finish_rollbacks()

    def finish_rollbacks(self) -> None:
        for _ in self.pending:
            self.pool.free(SLOTS)  # the plan's unready blocks are discarded
        self.pending = []

    def ranks(self, tp_size: int = 2) -> list[Session]:
        pid = os.getpid()  # alive: a writer is only given up on when it reports
        return [
            self.engines.join(
                "tp", f"s{r}", layout(r, tp_size), namespace_of(layout(r, tp_size)), pid
            )
            for r in range(tp_size)
        ]

    def save_plan(self, requester: Session) -> int:
        graph = TransferGraph()
        graph.add(OpKind.D2H, np.array([0, 1, 2]), SLOTS)
        self.engines.track(Plan(7, PlanKind.PUT, graph), requester)
        return 7


@pytest.mark.parametrize("deferred", [False, True], ids=["rolled-back-at-once", "rollback-later"])
def test_a_plan_given_up_by_one_rank_keeps_its_slots_until_the_other_reports(deferred):
    sidecar = Sidecar(deferred)
    leader, follower = sidecar.ranks()
    plan_id = sidecar.save_plan(leader)
    sidecar.engines.give_up(follower, plan_id)  # rank 1 failed; rank 0 may be copying
    assert plan_id in sidecar.engines.orphans and sidecar.pending == ([7] if deferred else [])
    sidecar.finish_rollbacks()  # the rollback frees the slots: they are not reusable
    assert sidecar.pool.num_free == 0 and sidecar.pool.num_held == 3
    sidecar.engines.writer_done(leader.session_id, plan_id)  # rank 0 reports at last
    assert plan_id not in sidecar.engines.orphans
    assert sorted(sidecar.pool.allocate(3).tolist()) == SLOTS.tolist()


def test_a_hold_ended_before_a_late_rollback_leaves_it_to_free_the_slots():
    sidecar = Sidecar(deferred=True)
    leader, follower = sidecar.ranks()
    plan_id = sidecar.save_plan(leader)
    sidecar.engines.give_up(follower, plan_id)
    sidecar.engines.writer_done(leader.session_id, plan_id)  # before the rollback ran
    assert sidecar.pool.num_held == 0 and sidecar.pool.num_free == 0
    sidecar.finish_rollbacks()
    assert sidecar.pool.num_free == 3


def test_the_requester_giving_up_before_its_own_copy_holds_nothing():
    """The other ranks get a plan from its requester after its own copies
    (KVClient.save): a requester failing or cancelling before it reported
    has handed it to nobody, so the slots come free at once."""
    sidecar = Sidecar(deferred=False)
    leader, _ = sidecar.ranks()
    plan_id = sidecar.save_plan(leader)
    sidecar.engines.give_up(leader, plan_id)
    assert not sidecar.engines.orphans and sidecar.pool.num_free == 3


def test_a_requester_giving_up_after_another_rank_reported_keeps_the_unreported_ranks_slots():
    """Another rank's report proves the plan was handed out: with three
    ranks, the one that has not reported yet may still be copying."""
    sidecar = Sidecar(deferred=False)
    leader, middle, last = sidecar.ranks(tp_size=3)
    plan_id = sidecar.save_plan(leader)
    sidecar.engines.plans[plan_id].report(middle.rank, 0)
    sidecar.engines.give_up(leader, plan_id)
    assert set(sidecar.engines.orphans[plan_id].writers) == {last.session_id}
    assert sidecar.pool.num_free == 0 and sidecar.pool.num_held == 3
    sidecar.engines.writer_done(last.session_id, plan_id)
    assert sidecar.pool.num_free == 3


def test_a_new_session_for_a_rank_whose_old_process_lives_keeps_the_old_saves_slots():
    """Two processes claiming one rank (a second client in a live process):
    the old session's save is rolled back, but its slots stay held until it
    reports or its process goes, as it may still be copying into them."""
    sidecar = Sidecar(deferred=False)
    leader, follower = sidecar.ranks()
    plan_id = sidecar.save_plan(leader)
    sidecar.engines.join("tp", "s0-again", layout(0), namespace_of(layout(0)), os.getpid())
    assert plan_id not in sidecar.engines.plans
    assert set(sidecar.engines.orphans[plan_id].writers) == {leader.session_id, follower.session_id}
    assert sidecar.pool.num_free == 0 and sidecar.pool.num_held == 3


def test_a_release_frees_every_slot_granted_to_the_rank_and_no_other():
    pool = Mempool(8)
    engines = Engines(
        lambda _group, _plan: None,
        lambda _group, slots: pool.hold(slots),
        lambda _group, slots: pool.release(slots),
        lambda _group, slots: pool.free(slots),
    )
    a, b = (engines.join(f"e{r}", f"s{r}", layout(0, 1), namespace_of(layout(0, 1)), 1)
            for r in range(2))  # fmt: skip
    a.granted.update(pool.allocate(5).tolist())
    b.granted.update(pool.allocate(2).tolist())
    ended = engines.num_ended
    engines.release_grant(a, abandoned_grant=7)
    assert pool.num_free == 6 and not a.granted and len(b.granted) == 2
    assert a.abandoned_grant == 7
    assert engines.num_ended == ended + 1  # parked loads are tried again
    engines.release_grant(a, abandoned_grant=-1)  # twice: nothing more to free
    assert pool.num_free == 6 and engines.num_ended == ended + 1
