"""Prometheus text endpoint: the main figures of `kvsidecar stats`, as gauges.

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
        tiers = s["tiers"]
        for name, doc in (
            ("capacity_bytes", "tier capacity in bytes"),
            ("capacity_blocks", "tier capacity in blocks"),
            ("used_blocks", "tier slots in use"),
            ("cached_blocks", "blocks in the tier's index"),
            ("evicted_blocks", "blocks evicted from the tier"),
        ):
            g = GaugeMetricFamily(f"kvsidecar_tier_{name}", doc, labels=["tier"])
            for tier, figures in tiers.items():
                if name in figures or tier == "cpu":
                    g.add_metric([tier], float(figures.get(name, 0)))
            yield g
        if "ssd" in tiers:
            yield from _tier_gauges("ssd", _SSD, tiers["ssd"])
        if "remote" in tiers:
            yield from _tier_gauges("remote", _REMOTE, tiers["remote"])
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
                "block hit ratio over the last hit_window lookups",
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
        yield _gauge(
            "kvsidecar_loop_lapses",
            "control-loop rounds that ran over a quarter lease beyond their wait "
            "for requests (each renewed every lease)",
            s["loop_lapses"],
        )
        errors = GaugeMetricFamily("kvsidecar_errors", "error replies by code", labels=["code"])
        for code, n in s["errors"].items():
            errors.add_metric([code], n)
        yield errors


_SSD = (
    ("direct_io", "1 while the SSD tier uses O_DIRECT, 0 on buffered I/O"),
    ("checksum_failures", "SSD blocks that failed their checksum (misses)"),
    ("io_errors", "failed SSD reads or writes"),
    ("ops_in_flight", "SSD I/O jobs queued or running"),
)
_REMOTE = (
    ("online", "1 while the remote store answers, 0 while it is marked unavailable"),
    ("puts_in_flight_blocks", "remote writes in flight, in blocks"),
    ("denied_puts", "remote writes denied by the in-flight quota"),
    ("denied_blocks", "blocks of remote writes denied by the in-flight quota"),
    ("probes", "existence probes sent to the remote store"),
    ("found_blocks", "blocks the probes found that this sidecar did not know of"),
    ("outages", "times the remote tier was marked unavailable"),
    ("checksum_failures", "remote values that failed their checksum (misses)"),
    ("missing_blocks", "indexed remote blocks the store no longer had (misses)"),
)


def _tier_gauges(
    tier: str, keys: tuple[tuple[str, str], ...], figures: dict[str, Any]
) -> Iterator[Metric]:
    for key, doc in keys:
        yield _gauge(f"kvsidecar_{tier}_{key}", doc, float(figures.get(key) or 0))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def serve_metrics(port: int, snapshot: Callable[[], dict[str, Any]]) -> Any:
    """Start the endpoint on 127.0.0.1:port; returns the HTTP server (call
    .shutdown() on it to stop)."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(snapshot))
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server
