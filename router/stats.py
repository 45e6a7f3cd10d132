"""Per-worker hit figures of the router's choices, cumulative and over the
last N requests routed to each worker.

A routed request of n blocks whose chosen worker already held h leading
blocks counts n requested and h hit; a request of no block (a prompt
shorter than one) counts in `requests` but not in the window. The sliding
window is the sidecar's `HitStats` (its CPU column carries the router's
predicted hits).
"""

from __future__ import annotations

from router.keys import Worker, WorkerId
from sidecar.control.hits import HitStats
from sidecar.control.plan import TierCounts


class RouterStats:
    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._workers: dict[Worker, HitStats] = {}
        self.total = HitStats(window)

    def record(self, worker: Worker, requested: int, hit: int) -> None:
        """ValueError (and nothing recorded) unless 0 <= hit <= requested."""
        if not 0 <= hit <= requested:
            raise ValueError(f"{hit} hit blocks for a request of {requested} blocks")
        stats = self._workers.get(worker)
        if stats is None:
            stats = self._workers[worker] = HitStats(self.window)
        counts = TierCounts(hit, 0, 0)
        stats.record(requested, counts)
        self.total.record(requested, counts)

    def forget(self, worker_id: WorkerId) -> None:
        """Drop the figures of every rank of `worker_id`."""
        for w in [w for w in self._workers if w.worker_id == worker_id]:
            del self._workers[w]

    def snapshot(self) -> dict[str, object]:
        return {
            "all": _figures(self.total),
            "workers": {str(w): _figures(s) for w, s in sorted(self._workers.items())},
        }


def _figures(stats: HitStats) -> dict[str, object]:
    snap = stats.snapshot()
    keep = ("requests", "requested_blocks", "hit_ratio", "window_requests", "window_hit_ratio")
    return {k: snap[k] for k in keep} | {"hit_blocks": stats.hit_blocks["cpu"]}
