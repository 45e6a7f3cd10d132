"""`sidecar/metrics/latency.py`: bucket counts with Prometheus's `le`
meaning, copies for the metrics thread, a shared histogram that loses no
observation across threads, requests whose reply waits timed to the reply,
and jobs timed whether they return or raise."""

from __future__ import annotations

import threading

import pytest

from sidecar.metrics.latency import (
    LATENCY_BUCKETS,
    LatencyHistogram,
    RequestLatency,
    SharedLatencyHistogram,
    timed,
)


def test_a_duration_counts_in_the_first_bucket_whose_bound_is_not_below_it():
    h = LatencyHistogram((0.001, 0.01))
    for seconds in (0.0005, 0.001, 0.002, 0.01, 3.0):
        h.observe(seconds)
    f = h.figures()
    assert f["buckets"] == [0.001, 0.01]
    assert f["counts"] == [2, 2, 1]  # le=0.001, le=0.01, +Inf
    assert f["count"] == 5 and f["sum"] == pytest.approx(3.0135)


def test_figures_are_a_copy():
    h = LatencyHistogram()
    f = h.figures()
    h.observe(1e-5)
    assert f["count"] == 0 and f["counts"] == [0] * (len(LATENCY_BUCKETS) + 1)


@pytest.mark.parametrize("bounds", [(), (0.1, 0.01), (0.1, 0.1)])
def test_bounds_must_increase(bounds):
    with pytest.raises(ValueError):
        LatencyHistogram(bounds)


def test_a_shared_histogram_counts_every_thread():
    h = SharedLatencyHistogram()

    def work() -> None:
        for _ in range(10_000):
            h.observe(1e-4)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.figures()["count"] == 40_000


def test_a_waiting_reply_is_timed_when_it_is_sent():
    latency = RequestLatency({int: "lookup"})
    h = latency.by_type[int]
    latency.wait(b"engine", 7, h, received=0.0)  # perf_counter() is far past 0
    latency.answered(b"other", 7)  # not the one waiting
    assert h.figures()["count"] == 0
    latency.answered(b"engine", 7)
    latency.answered(b"engine", 7)  # answered once only
    assert h.figures()["count"] == 1 and h.sum > 0
    assert latency.figures() == {"lookup": h.figures()}


def test_a_timed_job_is_observed_when_it_raises_too():
    h = LatencyHistogram()

    def job(lo: int, hi: int) -> int:
        if lo == hi:
            raise OSError("no blocks")
        return hi - lo

    run = timed(h, job)
    assert run(2, 5) == 3
    with pytest.raises(OSError):
        run(1, 1)
    assert h.figures()["count"] == 2
