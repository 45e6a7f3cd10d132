"""Mempool: slot order, errors, and that a failed call changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from contract.ids import SLOT_DTYPE
from sidecar.control.mempool import Mempool, MempoolError, OutOfSlots


def snapshot(pool: Mempool) -> tuple[int, list[bool]]:
    return pool.num_free, [pool.is_free(i) for i in range(pool.num_slots)]


def test_fresh_pool_hands_out_lowest_slots_in_order():
    pool = Mempool(6)
    assert (pool.num_free, pool.num_used) == (6, 0)
    first = pool.allocate(2)
    assert first.dtype == SLOT_DTYPE
    assert first.tolist() == [0, 1]
    assert pool.allocate(3).tolist() == [2, 3, 4]
    assert (pool.num_free, pool.num_used) == (1, 5)
    assert [pool.is_free(i) for i in range(6)] == [False] * 5 + [True]


def test_free_then_allocate_reuses_in_stack_order():
    pool = Mempool(6)
    pool.allocate(6)
    pool.free(np.array([4, 1]))
    assert pool.num_free == 2
    assert pool.is_free(4) and pool.is_free(1)
    # The freed run comes back in the order it was given.
    assert pool.allocate(2).tolist() == [4, 1]
    assert pool.num_free == 0


def test_allocate_zero_and_free_empty_change_nothing():
    pool = Mempool(3)
    pool.allocate(1)
    before = snapshot(pool)
    empty = pool.allocate(0)
    assert empty.size == 0 and empty.dtype == SLOT_DTYPE
    pool.free(np.empty(0, dtype=np.int64))
    assert snapshot(pool) == before


def test_allocate_everything_then_out_of_slots():
    pool = Mempool(4)
    pool.allocate(3)
    before = snapshot(pool)
    with pytest.raises(OutOfSlots):
        pool.allocate(2)
    assert snapshot(pool) == before
    assert pool.allocate(1).tolist() == [3]


def test_empty_pool():
    pool = Mempool(0)
    assert pool.allocate(0).size == 0
    with pytest.raises(OutOfSlots):
        pool.allocate(1)


def test_negative_sizes_are_rejected():
    with pytest.raises(ValueError):
        Mempool(-1)
    pool = Mempool(2)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert snapshot(pool) == (2, [True, True])


def test_unsigned_slots_are_accepted():
    pool = Mempool(4)
    pool.allocate(4)
    pool.free(np.array([2, 0], dtype=np.uint32))
    assert pool.allocate(2).tolist() == [2, 0]


BAD_FREES = {
    "double free": np.array([5]),
    "double free among used": np.array([1, 5]),
    "negative": np.array([-1]),
    "negative among used": np.array([1, -1]),
    "equal to num_slots": np.array([8]),
    "far out of range": np.array([1, 2, 1000]),
    "duplicate in one free": np.array([1, 1]),
    "duplicate among others": np.array([0, 2, 0]),
    "float dtype": np.array([1.0, 2.0]),
    "bool dtype": np.array([True, False]),
    "object dtype": np.array([1, 2], dtype=object),
}


@pytest.mark.parametrize("slots", BAD_FREES.values(), ids=BAD_FREES.keys())
def test_bad_free_raises_and_changes_nothing(slots):
    pool, twin = Mempool(8), Mempool(8)
    for p in (pool, twin):
        p.allocate(5)  # slots 0..4 used, 5..7 free
        p.free(np.array([3]))
    before = snapshot(pool)
    with pytest.raises(MempoolError):
        pool.free(slots)
    assert snapshot(pool) == before
    # The free stack is untouched too: both pools hand out the same slots.
    assert pool.allocate(pool.num_free).tolist() == twin.allocate(twin.num_free).tolist()


def test_free_of_a_zero_dim_array_frees_or_changes_nothing():
    """np.asarray(slot) of one slot is a 0-d array; the contract says a bad free
    raises and changes nothing, and a good one frees the slot."""
    pool = Mempool(4)
    pool.allocate(4)
    try:
        pool.free(np.array(3))
    except (MempoolError, TypeError, ValueError):
        assert snapshot(pool) == (0, [False] * 4)
    else:
        assert snapshot(pool) == (1, [False, False, False, True])


def test_take_marks_given_slots_used_and_refuses_bad_ones():
    pool = Mempool(6)
    pool.take(np.array([4, 1]))
    assert pool.num_free == 4 and not pool.is_free(4) and not pool.is_free(1)
    assert sorted(pool.allocate(4).tolist()) == [0, 2, 3, 5]
    pool.free(np.array([1]))
    for bad in ([1, 1], [6], [0], [-1]):
        with pytest.raises(MempoolError):
            pool.take(np.array(bad))
    assert pool.num_free == 1 and pool.allocate(1).tolist() == [1]


def test_held_slots_freed_meanwhile_come_free_only_when_released():
    pool = Mempool(6)
    a = pool.allocate(4)  # 0, 1, 2, 3
    pool.hold(a[:2])
    assert pool.num_held == 2
    pool.free(a)  # 0 and 1 are held: only 2 and 3 come free now
    assert pool.num_free == 4 and pool.num_used == 2
    assert not pool.is_free(0) and pool.is_free(2)
    assert sorted(pool.allocate(4).tolist()) == [2, 3, 4, 5]  # never 0 or 1
    with pytest.raises(MempoolError, match="double free"):
        pool.free(np.array([0]))  # freed once already, while held
    pool.release(a[:2])
    assert pool.num_held == 0 and pool.is_free(0) and pool.is_free(1)


def test_a_hold_released_before_the_free_leaves_the_slots_used_until_freed():
    pool = Mempool(4)
    a = pool.allocate(2)
    pool.hold(a)
    pool.release(a)
    assert pool.num_used == 2 and not pool.is_free(0)
    pool.free(a)
    assert pool.num_free == 4


def test_bad_holds_and_releases_raise_and_change_nothing():
    pool = Mempool(4)
    a = pool.allocate(2)
    with pytest.raises(MempoolError, match="used"):
        pool.hold(np.array([0, 3]))  # 3 is free
    pool.hold(a[:1])
    with pytest.raises(MempoolError, match="used"):
        pool.hold(a)  # 0 is held already
    with pytest.raises(MempoolError, match="not held"):
        pool.release(a)  # 1 is not held
    with pytest.raises(MempoolError, match="out of range"):
        pool.hold(np.array([9]))
    assert pool.num_held == 1 and pool.num_used == 2


def test_vacated_counts_every_slot_that_became_free():
    """What loads waiting for a free slot watch: frees, releases of held
    slots freed meanwhile, and granted ranges; allocations never lower it."""
    pool = Mempool(6)
    assert pool.vacated == 0
    a = pool.allocate(4)
    pool.free(a[:1])
    assert pool.vacated == 1
    pool.hold(a[1:3])
    pool.free(a[1:3])  # held: not free until released
    assert pool.vacated == 1
    pool.release(a[1:3])
    assert pool.vacated == 3
    pool.allocate(5)
    assert pool.vacated == 3
    shared = Mempool(8, owned=False)
    shared.grant(0, 4)
    assert shared.vacated == 4
