"""Fixed-size slot allocator for one tier (CPU shm slots, SSD slots, remote budget)."""

from __future__ import annotations

import numpy as np

from contract.ids import SLOT_DTYPE, SlotIds


class MempoolError(ValueError):
    """A slot was freed twice, or does not belong to this pool."""


class OutOfSlots(RuntimeError):
    """More slots were asked for than are free."""


class Mempool:
    """`num_slots` slots numbered 0..num_slots-1.

    allocate(n) and free(slots) cost O(n) numpy work, O(1) Python work: the
    free slots are a stack in one preallocated array, a boolean mask catches
    double frees and foreign slots, and a scratch array catches a slot repeated
    within one call without sorting. A bad `free` raises and changes nothing.

    `hold(slots)` keeps used slots from being handed out again until
    `release(slots)`, however they are freed meanwhile: a writer may still
    be copying into them (sidecar/server/sessions.py, orphans).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # Lowest slots on top of the stack, so a fresh pool hands out 0, 1, 2...
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=SLOT_DTYPE)
        self._top = num_slots
        self._is_free = np.ones(num_slots, dtype=np.bool_)
        # _scratch[s] = position of s in the current free() call (duplicate check).
        self._scratch = np.zeros(num_slots, dtype=np.int64)
        self._positions = np.arange(0, dtype=np.int64)
        self._held = np.zeros(num_slots, dtype=np.bool_)
        self._freed_held = np.zeros(num_slots, dtype=np.bool_)  # freed while held
        self._num_held = 0

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_slots - self._top

    def allocate(self, n: int) -> SlotIds:
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._top:
            raise OutOfSlots(f"asked for {n} slots, {self._top} free of {self.num_slots}")
        start = self._top - n
        slots = self._stack[start : self._top][::-1].copy()
        self._top = start
        self._is_free[slots] = False
        return SlotIds(slots)

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots).reshape(-1)
        if slots.size == 0:
            return
        if slots.dtype.kind not in "iu":
            raise MempoolError(f"slots must be integers, got dtype {slots.dtype}")
        if slots.min() < 0 or slots.max() >= self.num_slots:
            raise MempoolError(f"slot out of range 0..{self.num_slots - 1}: {slots}")
        freed = self._is_free[slots]
        if self._num_held:
            freed = freed | self._freed_held[slots]  # freed already, while held
        if freed.any():
            raise MempoolError(f"double free of slots {slots[freed]}")
        if slots.size > 1:
            # Write each slot's position; a repeated slot keeps only its last.
            if self._positions.size < slots.size:
                self._positions = np.arange(max(slots.size, 2 * self._positions.size))
            positions = self._positions[: slots.size]
            self._scratch[slots] = positions
            if not np.array_equal(self._scratch[slots], positions):
                raise MempoolError("the same slot appears twice in one free")
        if self._num_held:
            held = self._held[slots]
            if held.any():  # not free until released
                self._freed_held[slots[held]] = True
                slots = slots[~held]
        self._is_free[slots] = True
        self._stack[self._top : self._top + slots.size] = slots[::-1]
        self._top += slots.size

    def hold(self, slots: np.ndarray) -> None:
        """Keep these used slots from being allocated again until `release`:
        a `free` of one meanwhile takes effect at the release."""
        slots = np.unique(np.asarray(slots, dtype=np.int64).reshape(-1))
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.num_slots:
            raise MempoolError(f"slot out of range 0..{self.num_slots - 1}")
        if self._is_free[slots].any() or self._held[slots].any():
            raise MempoolError("only used slots that are not held already can be held")
        self._held[slots] = True
        self._num_held += int(slots.size)

    def release(self, slots: np.ndarray) -> None:
        """End a hold: the slots freed while held are free now."""
        slots = np.unique(np.asarray(slots, dtype=np.int64).reshape(-1))
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.num_slots or not self._held[slots].all():
            raise MempoolError("release of slots that are not held")
        self._held[slots] = False
        self._num_held -= int(slots.size)
        freed = slots[self._freed_held[slots]]
        self._freed_held[freed] = False
        self.free(freed)

    def free_slots(self) -> np.ndarray:
        """The free slots, in no particular order (a copy)."""
        free: np.ndarray = self._stack[: self._top].copy()  # numpy stubs: Any before 3.11
        return free

    @property
    def num_held(self) -> int:
        return self._num_held

    def take(self, slots: np.ndarray) -> None:
        """Mark these free slots used (a restart rebuilding its index from
        disk). O(num_slots); raises MempoolError and changes nothing if one
        is out of range, repeated or not free."""
        slots = np.asarray(slots).reshape(-1)
        if slots.size == 0:
            return
        if slots.dtype.kind not in "iu" or slots.min() < 0 or slots.max() >= self.num_slots:
            raise MempoolError(f"slots out of range 0..{self.num_slots - 1}")
        if np.unique(slots).size != slots.size or not self._is_free[slots].all():
            raise MempoolError("slots repeated or not free")
        self._is_free[slots] = False
        free = self._stack[: self._top]
        self._top = int(np.count_nonzero(self._is_free[free]))
        self._stack[: self._top] = free[self._is_free[free]]

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])
