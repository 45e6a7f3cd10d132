"""The client's own latency histogram, in the engine process's default
prometheus-client registry: an engine that already exports Prometheus
metrics (vLLM does) shows `kvsidecar_client_call_seconds{op=...}` beside
its own. One per process, shared by its clients (under prometheus-client's
multiprocess mode, summed across the engine's processes as usual).

Without prometheus-client installed nothing is recorded.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

try:
    import prometheus_client
except ImportError:  # optional in an engine process
    prometheus_client = None  # type: ignore[assignment]

P = ParamSpec("P")
R = TypeVar("R")

CALL_BUCKETS = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0,
)  # fmt: skip
"""Seconds: a call is a round trip to a sidecar on the same host (tens of
microseconds to a millisecond), more when a load waits for SSD or remote
reads, at most the client's timeout."""

OPS = ("lookup", "load", "save")


def _observers() -> dict[str, Callable[[float], None]]:
    if prometheus_client is None:
        return {op: lambda seconds: None for op in OPS}
    histogram = prometheus_client.Histogram(
        "kvsidecar_client_call_seconds",
        "KVClient calls to the sidecar (load and save: until their plan runs), in seconds",
        ["op"],
        buckets=CALL_BUCKETS,
    )
    return {op: histogram.labels(op=op).observe for op in OPS}


OBSERVE = _observers()
"""op -> observe(seconds) of its histogram (a no-op without prometheus-client)."""


def timed_call(op: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a KVClient method: each call's duration, whether it returns
    or raises, is observed under `op`."""
    observe = OBSERVE[op]

    def decorate(method: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                observe(time.perf_counter() - started)

        return call

    return decorate
