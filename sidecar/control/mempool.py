"""Fixed-size slot allocator for one tier (CPU shm slots, SSD slots, remote budget)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from contract.ids import SLOT_DTYPE, SlotIds


class MempoolError(ValueError):
    """A slot was freed twice, or does not belong to this pool."""


class OutOfSlots(RuntimeError):
    """More slots were asked for than are free."""


class Mempool:
    """Slots numbered 0..space-1, of which `num_slots` are this pool's to hand out.

    allocate(n) and free(slots) cost O(n) numpy work, O(1) Python work: the
    free slots are a stack in one preallocated array, a boolean mask catches
    double frees and foreign slots, and a scratch array catches a slot repeated
    within one call without sorting. A bad `free` raises and changes nothing.

    `hold(slots)` keeps used slots from being handed out again until
    `release(slots)`, however they are freed meanwhile: a writer may still
    be copying into them (sidecar/server/sessions.py, orphans).

    Ownership: a pool made with `owned=False` starts with no slots of its
    own; `grant` gives it ranges, `retire_free` and `retire` take them back.
    The CPU tier's geometries share one shm arena this way (`control.arena`):
    each geometry's pool spans every slot of its stride in the arena and
    owns the extents it was granted. A slot it does not own is neither
    handed out nor accepted back.
    """

    def __init__(self, num_slots: int, *, owned: bool = True) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.space = num_slots
        """Slots addressable: 0..space-1."""
        self.num_slots = num_slots if owned else 0
        """Slots owned: the pool's capacity."""
        # Lowest slots on top of the stack, so a fresh pool hands out 0, 1, 2...
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=SLOT_DTYPE)
        self._top = num_slots if owned else 0
        self._is_free = np.full(num_slots, owned, dtype=np.bool_)
        self._owned: np.ndarray | None = None if owned else np.zeros(num_slots, dtype=np.bool_)
        """None while every slot is owned (the common case costs no check)."""
        # _scratch[s] = position of s in the current free() call (duplicate check).
        self._scratch = np.zeros(num_slots, dtype=np.int64)
        self._positions = np.arange(0, dtype=np.int64)
        self._held = np.zeros(num_slots, dtype=np.bool_)
        self._freed_held = np.zeros(num_slots, dtype=np.bool_)  # freed while held
        self._num_held = 0
        self.vacated = 0
        """Slots that became free, ever (granted ones included): a count that
        only grows, which loads waiting for a free slot watch."""
        self.on_vacate: Callable[[np.ndarray], None] | None = None
        """Called with slots as they stop holding their blocks (`free`,
        `retire`), before they can be handed out again: the sidecar bumps
        their generations in the engines' hot index (sidecar/server/hotpath.py)."""

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
        if slots.min() < 0 or slots.max() >= self.space:
            raise MempoolError(f"slot out of range 0..{self.space - 1}: {slots}")
        if self._owned is not None and not self._owned[slots].all():
            raise MempoolError(f"slots not owned by this pool: {slots[~self._owned[slots]]}")
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
        if self.on_vacate is not None:
            self.on_vacate(slots)
        if self._num_held:
            held = self._held[slots]
            if held.any():  # not free until released
                self._freed_held[slots[held]] = True
                slots = slots[~held]
        self._is_free[slots] = True
        self._stack[self._top : self._top + slots.size] = slots[::-1]
        self._top += slots.size
        self.vacated += slots.size

    def hold(self, slots: np.ndarray) -> None:
        """Keep these used slots from being allocated again until `release`:
        a `free` of one meanwhile takes effect at the release."""
        slots = np.unique(np.asarray(slots, dtype=np.int64).reshape(-1))
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.space:
            raise MempoolError(f"slot out of range 0..{self.space - 1}")
        if self._owned is not None and not self._owned[slots].all():
            raise MempoolError("only owned slots can be held")
        if self._is_free[slots].any() or self._held[slots].any():
            raise MempoolError("only used slots that are not held already can be held")
        self._held[slots] = True
        self._num_held += int(slots.size)

    def release(self, slots: np.ndarray) -> None:
        """End a hold: the slots freed while held are free now."""
        slots = np.unique(np.asarray(slots, dtype=np.int64).reshape(-1))
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.space or not self._held[slots].all():
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
        if slots.dtype.kind not in "iu" or slots.min() < 0 or slots.max() >= self.space:
            raise MempoolError(f"slots out of range 0..{self.space - 1}")
        if self._owned is not None and not self._owned[slots].all():
            raise MempoolError("slots not owned by this pool")
        if np.unique(slots).size != slots.size or not self._is_free[slots].all():
            raise MempoolError("slots repeated or not free")
        self._is_free[slots] = False
        free = self._stack[: self._top]
        self._top = int(np.count_nonzero(self._is_free[free]))
        self._stack[: self._top] = free[self._is_free[free]]

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    # ---- ownership (`owned=False` pools) ---------------------------------------------

    def owns(self, slot: int) -> bool:
        return self._owned is None or bool(self._owned[slot])

    def grant(self, lo: int, hi: int) -> None:
        """Own slots lo..hi-1, all free. MempoolError, nothing changed, if
        one is out of range or owned already."""
        owned = self._ownership(lo, hi)
        if owned[lo:hi].any():
            raise MempoolError(f"slots {lo}..{hi - 1} are partly owned already")
        n = hi - lo
        owned[lo:hi] = True
        self._is_free[lo:hi] = True
        self._stack[self._top : self._top + n] = np.arange(hi - 1, lo - 1, -1)
        self._top += n
        self.num_slots += n
        self.vacated += n

    def retire_free(self, lo: int, hi: int) -> int:
        """Give up the free slots among lo..hi-1 (owned, not held); returns how
        many. Used slots of the range stay owned until `retire`d."""
        owned = self._ownership(lo, hi)
        free = self._stack[: self._top]
        leaving = (free >= lo) & (free < hi)
        n = int(np.count_nonzero(leaving))
        if n:
            gone = free[leaving]
            kept = free[~leaving]
            self._stack[: kept.size] = kept
            self._top = int(kept.size)
            self._is_free[gone] = False
            owned[gone] = False
            self.num_slots -= n
        return n

    def retire(self, slots: np.ndarray) -> None:
        """Give up used, owned, unheld slots (their blocks moved elsewhere)."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size == 0:
            return
        owned = self._ownership(int(slots.min()), int(slots.max()) + 1)
        if (
            not owned[slots].all()
            or self._is_free[slots].any()
            or self._held[slots].any()
            or np.unique(slots).size != slots.size
        ):
            raise MempoolError("only used, owned slots that are not held can be retired")
        if self.on_vacate is not None:
            self.on_vacate(slots)
        owned[slots] = False
        self.num_slots -= int(slots.size)

    def num_used_in(self, lo: int, hi: int) -> int:
        """Owned slots of lo..hi-1 that are not free."""
        owned = self._ownership(lo, hi)
        return int(np.count_nonzero(owned[lo:hi] & ~self._is_free[lo:hi]))

    def held_in(self, lo: int, hi: int) -> bool:
        """Whether a slot of lo..hi-1 is held (`hold`)."""
        return bool(self._num_held) and bool(self._held[lo:hi].any())

    def _ownership(self, lo: int, hi: int) -> np.ndarray:
        if not 0 <= lo <= hi <= self.space:
            raise MempoolError(f"slots {lo}..{hi - 1} out of range 0..{self.space - 1}")
        if self._owned is None:
            raise MempoolError("this pool owns every slot: it was not made with owned=False")
        return self._owned
