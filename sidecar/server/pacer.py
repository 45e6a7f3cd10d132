"""How much of the control loop `auto`'s shadows may take.

Each lookup's key chain is queued for the `auto` policy's shadows
(`sidecar/control/shadows.py`) and worked off by the loop after the
requests that are ready, and never while a request waits to be read
(`Server.poll_once`): a request that arrives during the work stops it
after the shadow step under way (one chain on one shadow index). Their
cost follows the lookups' volume (five shadow indexes per chain), so it is
paced: the work gets at most `share` of the loop's time, in slices of at
most `slice_seconds` (plus the step under way when the slice ends). Past
that the queue fills and drops new chains, which makes the shadows' sample
smaller and never slows a request by more than one step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SHARE = 0.25
"""Of the loop's time, at most this goes to the shadows."""
SLICE_SECONDS = 0.001
"""The longest slice of it, once the ready requests are served."""


class Pacer:
    """A budget of loop time that grows with the time that passes outside
    the work (share / (1 - share) of it, so that the work takes `share` of
    the whole), up to one slice, and shrinks by the time the work takes."""

    def __init__(
        self,
        share: float = SHARE,
        slice_seconds: float = SLICE_SECONDS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0.0 < share < 1.0 or slice_seconds <= 0.0:
            raise ValueError("share must be in (0, 1) and slice_seconds positive")
        self.share = share
        self._rate = share / (1.0 - share)
        """Budget gained per second outside the work: work / loop = share."""
        self.slice = slice_seconds
        self._clock = clock
        self._budget = slice_seconds
        self._mark = clock()
        self.spent = 0.0
        """Seconds given to the work in all."""

    def run(self, work: Callable[[float], bool]) -> float | None:
        """Give `work(deadline)` (whether any is left after it) what the budget
        allows now; how long the loop may wait before the next call: None
        when nothing is left (as long as it likes), 0 when work and budget
        are both left, else the time until a whole slice has accrued."""
        now = self._clock()
        self._budget = min(self.slice, self._budget + (now - self._mark) * self._rate)
        left = True
        if self._budget > 0.0:
            left = work(now + self._budget)
            done = self._clock()
            self._budget -= done - now
            self.spent += done - now
            now = done
        self._mark = now
        if not left:
            return None
        if self._budget > 0.0:
            return 0.0
        return (self.slice - self._budget) / self._rate
