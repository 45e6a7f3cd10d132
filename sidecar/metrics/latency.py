"""Latency histograms measured inside the sidecar, cheap enough for the
control loop's hot path.

`LatencyHistogram.observe` is a bisect and two additions on plain Python
objects (no lock, no prometheus-client call): the loop's thread owns it, and
`figures()`, called on that thread when the stats snapshot is published,
copies it for the metrics thread. `SharedLatencyHistogram` is the same under
a lock, for the I/O pools' threads, whose jobs take far longer than the lock.

The figures are Prometheus's histogram in plain numbers: `buckets` are the
upper bounds in seconds, `counts` the observations per bucket (not
cumulative; one more than `buckets`, the last past every bound), `sum` the
seconds observed in all.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds in seconds: a CPU-tier lookup takes tens of microseconds, an
SSD or remote op up to seconds."""


class LatencyHistogram:
    """Durations in seconds, counted per bucket. One thread only."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"bounds must be increasing and not empty, got {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: a duration equal to a bound counts in that bound's bucket (le).
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def figures(self) -> dict[str, Any]:
        """A copy: `buckets`, `counts`, `sum`, `count` (see the module doc)."""
        counts = list(self.counts)
        return {
            "buckets": list(self.bounds),
            "counts": counts,
            "sum": self.sum,
            "count": sum(counts),
        }


class SharedLatencyHistogram(LatencyHistogram):
    """A `LatencyHistogram` that any thread may update."""

    __slots__ = ("_lock",)

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        super().__init__(bounds)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            super().observe(seconds)

    def figures(self) -> dict[str, Any]:
        with self._lock:
            return super().figures()


class RequestLatency:
    """Request received -> reply sent, per op, for the handlers (on the loop's
    thread). A reply that waits (for a remote probe, a staging, a free CPU
    slot) is timed from its request's arrival to the reply that answers it."""

    def __init__(self, ops: dict[type, str]) -> None:
        """`ops`: request type -> the op name its histogram reports under."""
        self.names = ops
        self.by_type = {kind: LatencyHistogram() for kind in ops}
        """What `Handlers.serve` looks a request's histogram up in (None: not timed)."""
        self._waiting: dict[tuple[bytes, int], tuple[LatencyHistogram, float]] = {}

    def wait(
        self, identity: bytes, request_id: int, histogram: LatencyHistogram, received: float
    ) -> None:
        """A timed request whose reply waits."""
        self._waiting[(identity, request_id)] = (histogram, received)

    def answered(self, identity: bytes, request_id: int) -> None:
        """A waiting reply was sent (nothing to do for one never waiting)."""
        waited = self._waiting.pop((identity, request_id), None)
        if waited is not None:
            waited[0].observe(time.perf_counter() - waited[1])

    def figures(self) -> dict[str, dict[str, Any]]:
        return {self.names[kind]: h.figures() for kind, h in self.by_type.items()}


def timed(histogram: LatencyHistogram, job: Callable[[int, int], T]) -> Callable[[int, int], T]:
    """`job` (over blocks [lo, hi) of an op, run on an I/O thread), its
    duration observed in `histogram` whether it returns or raises."""

    def run(lo: int, hi: int) -> T:
        started = time.perf_counter()
        try:
            return job(lo, hi)
        finally:
            histogram.observe(time.perf_counter() - started)

    return run
