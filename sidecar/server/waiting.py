"""Loads whose reply waits: for a staging plan, or for a free CPU slot.

A load whose blocks past the CPU prefix sit on SSD or in the remote store is
answered after a staging plan copied them into the CPU tier (`deferred`,
by that plan's id). One that found no CPU slot free (they were held by
writes in flight or by engines' open plans) is `parked` until some plan
ends, then tried again; so is a part of a load asked for in parts, whose
blocks a staging is still filling: it is tried again as soon as blocks
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
        self.parked_at = 0
        """The handlers' progress count (plans ended, staged parts made
        ready) when the parked loads were last tried."""

    def defer(self, plan_id: int, load: WaitingLoad) -> None:
        self.deferred[plan_id] = load

    def park(self, load: WaitingLoad, progress: int) -> None:
        self.parked.append(load)
        self.parked_at = progress

    def due(self, progress: int) -> bool:
        """Parked loads wait, and there was progress since they were last tried."""
        return bool(self.parked) and progress != self.parked_at

    def take(self, plan_id: int | None, progress: int) -> list[WaitingLoad]:
        """The parked loads and the one deferred for `plan_id` (if any), to be
        tried again now."""
        ready = self.deferred.pop(plan_id, None) if plan_id is not None else None
        retry, self.parked = [*self.parked, *([ready] if ready is not None else [])], []
        self.parked_at = progress
        return retry

    def take_all(self) -> list[WaitingLoad]:
        """Every waiting load (shutting down: each gets an error reply)."""
        every = [*self.deferred.values(), *self.parked]
        self.deferred.clear()
        self.parked.clear()
        return every
