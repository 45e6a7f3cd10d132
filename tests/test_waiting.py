"""WaitingLoads: which waiting loads a trigger brings back."""

from __future__ import annotations

from contract import protocol as p
from sidecar.server.waiting import WaitingLoad, WaitingLoads


def load(rid: int) -> WaitingLoad:
    return WaitingLoad(b"engine", p.Load(v=p.PROTOCOL_VERSION, id=rid, session="s"), [], 1)


def test_a_part_made_ready_retries_the_loads_waiting_for_a_filling_not_those_short_of_slots():
    w = WaitingLoads()
    w.park(load(1), room=5)  # no CPU slot free: each try costs one of its attempts
    w.wait_fill(load(2), progress=9)  # blocks a staging is filling
    assert w.waiting and not w.due(5, 9)
    assert w.due(5, 10)  # a staged part became ready: frees no slot
    assert [x.request.id for x in w.take_unparked(None, 10)] == [2]
    assert w.take_parked(False, 5) == []
    assert w.parked and not w.filling and not w.due(5, 10)
    assert w.due(6, 10)  # a slot was freed or a block became evictable
    assert w.take_unparked(None, 10) == []
    assert [x.request.id for x in w.take_parked(False, 6)] == [1]
    assert not w.waiting


def test_a_staging_plan_ending_retries_every_waiting_load_its_own_first():
    """Its own load first, then those waiting for a filling, then those short
    of slots: the first two lock the blocks just staged before a parked
    load's staging may evict them."""
    w = WaitingLoads()
    w.defer(7, load(1))
    w.defer(8, load(2))
    w.park(load(3), room=1)
    w.wait_fill(load(4), progress=1)
    assert [x.request.id for x in w.take_unparked(7, 1)] == [1, 4]
    assert [x.request.id for x in w.take_parked(True, 1)] == [3]
    assert [x.request.id for x in w.take_all()] == [2]


def test_a_load_joining_the_filling_waiters_hides_no_part_made_ready_before_it():
    w = WaitingLoads()
    w.wait_fill(load(1), progress=3)
    w.wait_fill(load(2), progress=4)  # a part became ready in the same round, before it parked
    assert w.due(0, 4)
    assert [x.request.id for x in w.take_unparked(None, 4)] == [1, 2]


def test_parked_loads_are_due_once_nothing_they_wait_for_is_in_flight():
    """A save rolled back for an engine that went away reports no end and
    may free nothing (its slots held for an orphan): with no data-plane
    plan left, parked loads are tried again all the same."""
    w = WaitingLoads()
    w.park(load(1), room=4)
    assert not w.due(4, 0) and w.due(4, 0, idle=True)
    assert w.take_parked(False, 4) == []
    assert [x.request.id for x in w.take_parked(False, 4, idle=True)] == [1]


def test_a_trigger_with_no_slot_to_be_had_is_noted_and_the_next_one_awaited():
    w = WaitingLoads()
    w.park(load(1), room=4)
    assert w.due(5, 0)  # a slot may have come free...
    w.no_room(5)  # ...but none can be had: not checked again every loop round
    assert not w.due(5, 0) and w.parked
    assert w.due(6, 0)
    assert [x.request.id for x in w.take_parked(False, 6)] == [1]
