"""Loads whose reply waits: for a staging plan, or for a free CPU slot.

A load whose blocks past the CPU prefix sit on SSD or in the remote store is
answered after a staging plan copied them into the CPU tier (`deferred`,
by that plan's id). One that found no CPU slot free (they were held by
writes in flight or by engines' open plans) is `parked` until a slot may
have come free (one was freed, or a block became evictable: the handlers'
`room` count grew), a plan of the data plane ended, or none is left in
flight (one rolled back reports no end), then tried again:
each try costs it one of its staging attempts, so plans whose end frees
nothing (another engine's loads, each part of a load in parts) must not
bring it back. One whose blocks a staging is still filling (a
part of a load asked for in parts, or a load of a prefix another load is
staging) waits for that `filling`: it is tried again as soon as blocks
become ready (a staging made ready part by part), or a plan ends.
"""

from __future__ import annotations

from typing import NamedTuple

from contract import protocol as p


class WaitingLoad(NamedTuple):
    identity: bytes
    """Who asked (the ROUTER identity the reply goes to)."""
    request: p.Load
    arrays: list[bytes]
    attempt: int
    """Stagings tried so far (see handlers.MAX_STAGING_ATTEMPTS)."""


class WaitingLoads:
    def __init__(self) -> None:
        self.deferred: dict[int, WaitingLoad] = {}
        """Staging plan id -> the load waiting for it."""
        self.parked: list[WaitingLoad] = []
        """Loads that found no CPU slot free: tried again when one may be."""
        self.parked_at = 0
        """The handlers' room count (slots freed, blocks made evictable) when
        the parked loads were last tried."""
        self.filling: list[WaitingLoad] = []
        """Loads whose blocks a staging is filling: tried again as its parts
        become ready, or a plan ends (it costs them no try)."""
        self.filling_at = 0
        """The handlers' progress count (plans ended, staged parts made
        ready) when the filling loads were last tried."""

    def defer(self, plan_id: int, load: WaitingLoad) -> None:
        self.deferred[plan_id] = load

    def park(self, load: WaitingLoad, room: int) -> None:
        self.parked.append(load)
        self.parked_at = room

    def wait_fill(self, load: WaitingLoad, progress: int) -> None:
        if not self.filling:  # else a part made ready this round would go unseen
            self.filling_at = progress
        self.filling.append(load)

    @property
    def waiting(self) -> bool:
        """Loads are parked or wait for a filling."""
        return bool(self.parked or self.filling)

    def due(self, room: int, progress: int, idle: bool = False) -> bool:
        """Loads wait whose trigger came since they were last tried (`idle`:
        no data-plane plan is in flight, so nothing a parked load waits for
        is left, e.g. a save rolled back without reporting an end)."""
        return bool(self.parked and (idle or room != self.parked_at)) or bool(
            self.filling and progress != self.filling_at
        )

    def take_unparked(self, plan_id: int | None, progress: int) -> list[WaitingLoad]:
        """The loads to try again first: the one deferred for `plan_id` (if
        any), then the filling ones if a data-plane plan ended or there was
        progress since. Loads whose blocks were just staged go before the
        parked ones (`take_parked`), so that they lock those blocks before a
        parked load's staging may evict them."""
        ready = self.deferred.pop(plan_id, None) if plan_id is not None else None
        retry = [] if ready is None else [ready]
        if plan_id is not None or progress != self.filling_at:
            retry += self.filling
            self.filling, self.filling_at = [], progress
        return retry

    def no_room(self, room: int) -> None:
        """Their trigger came but no CPU slot can be had now: the parked
        loads wait for the next (not checked again every loop round)."""
        self.parked_at = room

    def take_parked(self, plan_ended: bool, room: int, idle: bool = False) -> list[WaitingLoad]:
        """The parked loads, if a data-plane plan ended, there may be room
        since they were last tried, or (`idle`) nothing they wait for is
        left in flight."""
        if not (plan_ended or room != self.parked_at or idle):
            return []
        retry, self.parked, self.parked_at = self.parked, [], room
        return retry

    def take_all(self) -> list[WaitingLoad]:
        """Every waiting load (shutting down: each gets an error reply)."""
        every = [*self.deferred.values(), *self.parked, *self.filling]
        self.deferred.clear()
        self.parked.clear()
        self.filling.clear()
        return every
