"""Prometheus metrics of a running sidecar, made from its stats snapshot.

The collector runs on the HTTP server's thread and never touches live cache
state: the control loop publishes a fresh stats snapshot (a new dict, swapped
in whole) at least once a second, and the collector reads it. Monotonic
counts are counters (`_total`), levels are gauges, latencies are histograms
in seconds (docs/sidecar.md lists them all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sidecar.control.hits import TIERS


class StatsCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        if not s:
            return
        yield from _tier_metrics(s["tiers"])
        yield from _lookup_metrics(s["hits"], s["tiers"])
        yield from _request_metrics(s)
        yield from _namespace_metrics(s.get("namespaces", []))
        if "ssd" in s["tiers"]:
            yield from _lower_tier_metrics("ssd", _SSD_GAUGES, _SSD_COUNTERS, s["tiers"]["ssd"])
        if "remote" in s["tiers"]:
            remote = s["tiers"]["remote"]
            yield from _lower_tier_metrics("remote", _REMOTE_GAUGES, _REMOTE_COUNTERS, remote)
        yield _histogram(
            "kvsidecar_request_seconds",
            "request received to reply sent, in the sidecar (load and save: the plan)",
            s.get("latency", {}),
        )
        for tier, name, doc in (
            ("ssd", "kvsidecar_ssd_io_seconds", "an SSD read or write job on an I/O thread"),
            ("remote", "kvsidecar_remote_io_seconds", "a remote get or put job on a worker"),
        ):
            if tier in s["tiers"]:
                yield _histogram(name, doc, s["tiers"][tier].get("latency", {}))


MAX_LABELED_NAMESPACES = 32
"""Namespaces given labels of their own: the first 32 the sidecar numbered
(and "(unknown)", number 0); the rest are summed under model="_other", so the
label cardinality stays bounded. A fixed set, so that a counter never moves
between a label and `_other` (a counter that goes down reads as a reset)."""


def _namespace_metrics(rows: list[dict[str, Any]]) -> Iterator[Metric]:
    labeled = [r for r in rows if r["id"] <= MAX_LABELED_NAMESPACES]
    rest = [r for r in rows if r["id"] > MAX_LABELED_NAMESPACES]
    labels = ["model", "revision", "tenant"]
    stored = GaugeMetricFamily(
        "kvsidecar_namespace_bytes",
        "bytes of a namespace's blocks in a tier",
        labels=[*labels, "tier"],
    )
    asked = CounterMetricFamily(
        "kvsidecar_namespace_lookup_blocks", "blocks a namespace's lookups asked for", labels=labels
    )
    hit = CounterMetricFamily(
        "kvsidecar_namespace_hit_blocks", "of those, blocks found in a tier", labels=labels
    )
    groups = [([r["model"], r["revision"], r["tenant"]], [r]) for r in labeled]
    if rest:
        groups.append((["_other", "", ""], rest))
    for names, members in groups:
        tiers: dict[str, int] = {}
        for row in members:
            for tier, use in row["tiers"].items():
                tiers[tier] = tiers.get(tier, 0) + use["bytes"]
        for tier, nbytes in tiers.items():
            stored.add_metric([*names, tier], float(nbytes))
        asked.add_metric(names, float(sum(r["lookup_blocks"] for r in members)))
        hit.add_metric(names, float(sum(r["hit_blocks"] for r in members)))
    yield stored
    yield asked
    yield hit


def _tier_metrics(tiers: dict[str, Any]) -> Iterator[Metric]:
    for name, doc in (
        ("capacity_bytes", "tier capacity in bytes"),
        ("capacity_blocks", "tier capacity in blocks"),
        ("used_blocks", "tier slots in use"),
        ("cached_blocks", "blocks in the tier's index"),
    ):
        g = GaugeMetricFamily(f"kvsidecar_tier_{name}", doc, labels=["tier"])
        for tier, figures in tiers.items():
            if name in figures or tier == "cpu":
                g.add_metric([tier], float(figures.get(name, 0)))
        yield g
    evicted = CounterMetricFamily(
        "kvsidecar_tier_evicted_blocks", "blocks evicted from the tier", labels=["tier"]
    )
    for tier, figures in tiers.items():
        evicted.add_metric([tier], float(figures.get("evicted_blocks", 0)))
    yield evicted


def _lookup_metrics(hits: dict[str, Any], tiers: dict[str, Any]) -> Iterator[Metric]:
    """Hits and misses per tier: a lookup asks each tier for the blocks the
    tiers before it lack; a tier's misses are those it lacks too."""
    requested = hits["requested_blocks"]
    block_bytes = tiers["cpu"].get("block_bytes", 0)  # known once an engine registered
    yield _counter("kvsidecar_lookups", "lookups counted in hit ratios", hits["requests"])
    yield _counter("kvsidecar_lookup_blocks", "blocks asked for by lookups", requested)
    families = {
        (kind, unit): CounterMetricFamily(
            f"kvsidecar_lookup_{kind}_{unit}",
            f"{unit} of looked-up blocks the tier {'held' if kind == 'hit' else 'lacked'}"
            " (past the tiers before it)",
            labels=["tier"],
        )
        for kind in ("hit", "miss")
        for unit in ("blocks", "bytes")
    }
    served = 0
    for tier in TIERS:  # in the order a lookup asks them
        if tier not in tiers:
            continue
        hit = hits["hit_blocks"][tier]
        served += hit
        for kind, n in (("hit", hit), ("miss", requested - served)):
            families[kind, "blocks"].add_metric([tier], float(n))
            families[kind, "bytes"].add_metric([tier], float(n * block_bytes))
    yield from families.values()
    for name, ratios, doc in (
        ("kvsidecar_hit_ratio", hits["hit_ratio_by_tier"], "cumulative block hit ratio"),
        (
            "kvsidecar_window_hit_ratio",
            hits["window_hit_ratio_by_tier"],
            "block hit ratio over the last hit_window lookups",
        ),
    ):
        g = GaugeMetricFamily(name, doc, labels=["tier"])
        for tier, value in ratios.items():
            g.add_metric([tier], value)
        yield g


def _request_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    requests = CounterMetricFamily("kvsidecar_requests", "requests received, by op", labels=["op"])
    for op, n in s["requests"].items():
        requests.add_metric([op], float(n))
    yield requests
    errors = CounterMetricFamily("kvsidecar_errors", "error replies, by code", labels=["code"])
    for code, n in s["errors"].items():
        errors.add_metric([code], float(n))
    yield errors
    transfers = s.get("transfers", {})
    yield _counter("kvsidecar_loads", "load plans answered", transfers.get("loads", 0))
    yield _counter(
        "kvsidecar_loaded_blocks",
        "blocks load plans copied to engines (lower tiers' blocks staged into the CPU tier first)",
        transfers.get("loaded_blocks", 0),
    )
    yield _counter("kvsidecar_saves", "save plans answered", transfers.get("saves", 0))
    yield _counter(
        "kvsidecar_saved_blocks",
        "blocks save plans stored (not those already cached)",
        transfers.get("saved_blocks", 0),
    )
    yield _gauge("kvsidecar_plans_in_flight", "plans not yet finished", s["plans_in_flight"])
    yield _gauge("kvsidecar_engines", "engines registered", len(s["engines"]))
    yield _counter("kvsidecar_expired_sessions", "sessions dropped by lease", s["expired_sessions"])
    yield _counter(
        "kvsidecar_loop_lapses",
        "control-loop rounds that ran over a quarter lease beyond their wait "
        "for requests (each renewed every lease)",
        s["loop_lapses"],
    )


_SSD_GAUGES = (
    ("direct_io", "1 while the SSD tier uses O_DIRECT, 0 on buffered I/O"),
    ("ops_in_flight", "SSD I/O jobs queued or running"),
)
_SSD_COUNTERS = (
    ("checksum_failures", "SSD blocks that failed their checksum (misses)"),
    ("io_errors", "failed SSD reads or writes"),
)
_REMOTE_GAUGES = (
    ("online", "1 while the remote store answers, 0 while it is marked unavailable"),
    ("puts_in_flight_blocks", "remote writes in flight, in blocks"),
    ("ops_in_flight", "remote jobs queued or running"),
)
_REMOTE_COUNTERS = (
    ("denied_puts", "remote writes denied by the in-flight quota"),
    ("denied_blocks", "blocks of remote writes denied by the in-flight quota"),
    ("probes", "probes (header reads) sent to the remote store"),
    ("found_blocks", "blocks the probes found that this sidecar did not know of"),
    ("outages", "times the remote tier was marked unavailable"),
    ("checksum_failures", "remote values that failed their checksum (misses)"),
    ("missing_blocks", "indexed remote blocks the store no longer had (misses)"),
    ("errors", "remote ops or probes that failed other than by an outage"),
)


def _lower_tier_metrics(
    tier: str,
    gauges: tuple[tuple[str, str], ...],
    counters: tuple[tuple[str, str], ...],
    figures: dict[str, Any],
) -> Iterator[Metric]:
    for key, doc in gauges:
        yield _gauge(f"kvsidecar_{tier}_{key}", doc, float(figures.get(key) or 0))
    for key, doc in counters:
        yield _counter(f"kvsidecar_{tier}_{key}", doc, float(figures.get(key) or 0))


def _histogram(name: str, doc: str, by_op: dict[str, dict[str, Any]]) -> HistogramMetricFamily:
    """One histogram per op from `LatencyHistogram.figures()` (per-bucket
    counts) in Prometheus's form (cumulative counts, the last `+Inf`)."""
    family = HistogramMetricFamily(name, doc + ", in seconds", labels=["op"])
    for op, h in by_op.items():
        cumulative, buckets = 0, []
        for bound, n in zip([*h["buckets"], float("inf")], h["counts"], strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), float(cumulative)))  # type: ignore[no-untyped-call]
        family.add_metric([op], buckets, h["sum"])
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """`name` without `_total`: prometheus-client adds it."""
    return CounterMetricFamily(name, doc, value=float(value))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))
