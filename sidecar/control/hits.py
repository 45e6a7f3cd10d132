"""Hit ratios the way Dynamo's KVBM reports them: cumulative, and over the last
N requests (a sliding window), per tier.

A lookup of n blocks that finds h of them cached counts n requested and h
hit; h is split by the tier the blocks would load from (CPU, then SSD past
the CPU prefix, then remote past both).
"""

from __future__ import annotations

from collections import deque

from sidecar.control.plan import TierCounts

TIERS = ("cpu", "ssd", "remote")


class HitStats:
    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.requests = 0
        self.requested_blocks = 0
        self._hits = [0, 0, 0]  # per tier, in TIERS order
        self._recent: deque[tuple[int, TierCounts]] = deque()
        self._recent_requested = 0
        self._recent_hits = [0, 0, 0]

    @property
    def hit_blocks(self) -> dict[str, int]:
        """Hit blocks per tier since start."""
        return dict(zip(TIERS, self._hits, strict=True))

    def record(self, requested: int, hits: TierCounts) -> None:
        """One lookup: `requested` blocks asked, `hits` found per tier
        (ValueError unless each is >= 0 and they add up to at most
        `requested`). A lookup of no block says nothing about hits: it counts
        in `requests` but stays out of the window. Runs on every lookup: plain
        int arithmetic, no per-tier loop."""
        cpu, ssd, remote = hits
        if cpu < 0 or ssd < 0 or remote < 0 or cpu + ssd + remote > requested:
            raise ValueError(f"{hits} hit blocks for a lookup of {requested} blocks")
        self.requests += 1
        if not requested:
            return
        self.requested_blocks += requested
        total, recent = self._hits, self._recent_hits
        total[0] += cpu
        total[1] += ssd
        total[2] += remote
        recent[0] += cpu
        recent[1] += ssd
        recent[2] += remote
        self._recent_requested += requested
        self._recent.append((requested, hits))
        if len(self._recent) > self.window:
            old_requested, (cpu, ssd, remote) = self._recent.popleft()
            self._recent_requested -= old_requested
            recent[0] -= cpu
            recent[1] -= ssd
            recent[2] -= remote

    def snapshot(self) -> dict[str, object]:
        """Plain figures: ratios are hit blocks / requested blocks (0 when none)."""
        hit_blocks = self.hit_blocks
        recent_hits = dict(zip(TIERS, self._recent_hits, strict=True))
        total = sum(hit_blocks.values())
        recent = sum(recent_hits.values())
        return {
            "requests": self.requests,
            "requested_blocks": self.requested_blocks,
            "hit_blocks": hit_blocks,
            "hit_ratio": _ratio(total, self.requested_blocks),
            "hit_ratio_by_tier": {
                t: _ratio(n, self.requested_blocks) for t, n in hit_blocks.items()
            },
            "window_requests": len(self._recent),
            "window_hit_ratio": _ratio(recent, self._recent_requested),
            "window_hit_ratio_by_tier": {
                t: _ratio(n, self._recent_requested) for t, n in recent_hits.items()
            },
        }


def split_hits(counts: TierCounts) -> TierCounts:
    """Ready-prefix lengths per tier -> blocks each tier would serve."""
    cpu = counts.cpu
    ssd = max(0, counts.ssd - cpu)
    remote = max(0, counts.remote - max(cpu, counts.ssd))
    return TierCounts(cpu, ssd, remote)


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0
