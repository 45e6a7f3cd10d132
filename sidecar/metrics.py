"""Prometheus text endpoint: the figures of `kvsidecar stats`, as gauges.

The HTTP server runs in prometheus-client's own thread. It never touches
live cache state: the control loop publishes a fresh stats snapshot (a new
dict, swapped in whole) at least once a second, and the collector reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


class StatsCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        if not s:
            return
        cpu = s["tiers"]["cpu"]
        for name, key, doc in (
            ("capacity_bytes", "capacity_bytes", "CPU tier capacity in bytes"),
            ("capacity_blocks", "capacity_blocks", "CPU tier capacity in blocks"),
            ("used_blocks", "used_blocks", "CPU tier slots in use"),
            ("cached_blocks", "cached_blocks", "blocks in the CPU tier index"),
            ("evicted_blocks", "evicted_blocks", "blocks evicted from the CPU tier"),
        ):
            g = GaugeMetricFamily(f"kvsidecar_tier_{name}", doc, labels=["tier"])
            g.add_metric(["cpu"], float(cpu.get(key, 0)))
            yield g
        hits = s["hits"]
        yield _gauge("kvsidecar_requests", "lookups counted in hit ratios", hits["requests"])
        yield _gauge(
            "kvsidecar_requested_blocks", "blocks asked for by lookups", hits["requested_blocks"]
        )
        for prefix, ratios, doc in (
            ("kvsidecar_hit_ratio", hits["hit_ratio_by_tier"], "cumulative block hit ratio"),
            (
                "kvsidecar_window_hit_ratio",
                hits["window_hit_ratio_by_tier"],
                f"block hit ratio over the last {hits['window_requests']} lookups",
            ),
        ):
            g = GaugeMetricFamily(prefix, doc, labels=["tier"])
            for tier, value in ratios.items():
                g.add_metric([tier], value)
            yield g
        yield _gauge("kvsidecar_plans_in_flight", "plans not yet finished", s["plans_in_flight"])
        yield _gauge("kvsidecar_engines", "engines registered", len(s["engines"]))
        yield _gauge(
            "kvsidecar_expired_sessions", "sessions dropped by lease", s["expired_sessions"]
        )
        errors = GaugeMetricFamily("kvsidecar_errors", "error replies by code", labels=["code"])
        for code, n in s["errors"].items():
            errors.add_metric([code], n)
        yield errors


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def serve_metrics(port: int, snapshot: Callable[[], dict[str, Any]]) -> Any:
    """Start the endpoint on 127.0.0.1:port; returns the HTTP server (call
    .shutdown() on it to stop)."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(snapshot))
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server
