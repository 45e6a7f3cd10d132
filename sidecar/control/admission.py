"""When the remote tier is asked at all: AIBrix's rules for its L2 cache.

- `DoubleGetRule`: a GET goes to the remote tier only when enough of the
  request is missing locally, in blocks and as a share of the request; a
  round trip for one block of a long prompt costs more than it saves.
- `PutQuota`: writes to the remote tier are asynchronous, and at most
  `limit` blocks may be in flight at once. Past it a write is DENIED
  (counted, never queued), so a slow store cannot make memory or plans pile
  up without bound.
"""

from __future__ import annotations

from typing import NamedTuple


class DoubleGetRule(NamedTuple):
    min_blocks: int = 1
    """Ask only when at least this many blocks are missing locally."""
    min_share: float = 0.0
    """... and they are at least this share of the request."""

    def allows(self, missing: int, total: int) -> bool:
        if missing <= 0 or missing < self.min_blocks:
            return False
        return missing >= self.min_share * total


class PutQuota:
    """Blocks of remote writes in flight, per (plan, op), bounded by `limit`.

    `admit(n)` grants up to n blocks (what is left of the quota) and counts
    the rest as denied; `hold` records a granted write under its op; the
    op's blocks come back when it completes (`release_op`) or its plan ends
    (`release_plan`).
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.denied_blocks = 0
        self.denied_puts = 0
        self._held: dict[int, dict[int, int]] = {}

    def admit(self, n: int) -> int:
        """How many of n blocks may be written now; the rest are denied."""
        granted = max(0, min(n, self.limit - self.in_flight))
        if granted < n:
            self.denied_blocks += n - granted
            self.denied_puts += 1
        return granted

    def hold(self, plan_id: int, op_id: int, n: int) -> None:
        self._held.setdefault(plan_id, {})[op_id] = n
        self.in_flight += n

    def release_op(self, plan_id: int, op_id: int) -> None:
        ops = self._held.get(plan_id)
        if ops is not None and op_id in ops:
            self.in_flight -= ops.pop(op_id)
            if not ops:
                del self._held[plan_id]

    def release_plan(self, plan_id: int) -> None:
        for n in self._held.pop(plan_id, {}).values():
            self.in_flight -= n
