"""The figures a running sidecar reports (`kvsidecar stats`, Prometheus)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from sidecar.control.cache_engine import CacheEngine

if TYPE_CHECKING:
    from sidecar.server.server import Server


def _lower_tiers(server: Server) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if server.cache is None:
        return out
    ssd_tier = server.cache.lower.get("ssd")
    if ssd_tier is not None and server.ssd is not None:
        ops = server.dataplane.tiers.get("ssd") if server.dataplane else None
        counters = ops.counters if ops is not None else {}
        out["ssd"] = {
            **_tier_figures(ssd_tier),
            "slot_bytes": server.ssd.slot_bytes,
            "direct_io": server.ssd.direct,
            "checksum_failures": counters.get("checksum_failures", 0),
            "io_errors": counters.get("io_errors", 0),
            "ops_in_flight": server.io.in_flight if server.io else 0,
        }
    remote_tier = server.cache.lower.get("remote")
    if remote_tier is not None and server.remote is not None:
        out["remote"] = {**_tier_figures(remote_tier), **server.remote.figures()}
    return out


def server_stats(server: Server) -> dict[str, Any]:
    """Every figure `kvsidecar stats` prints and the metrics endpoint exports."""
    cpu: dict[str, Any] = {"capacity_bytes": server.capacity}
    if server.pool is not None:
        cpu["prefault_seconds"] = server.pool.prefault_seconds
        cpu["segments"] = len(server.pool.segment_names)
        cpu["directory"] = server.pool.directory or "/dev/shm"
        cpu["page_kind"] = server.pool.page_kind
        cpu["huge_bytes"] = server.pool.pages.huge_bytes
    if server.cache is not None and server.layout is not None:
        tier = server.cache.cpu
        cpu.update(
            _tier_figures(tier),
            block_bytes=server.layout.block_bytes,
            slot_stride=server.layout.slot_stride,
        )
    return {
        "instance": server.config.instance,
        "endpoint": server.endpoint,
        "pid": os.getpid(),
        "boot_id": server.boot_id,
        "uptime_seconds": time.time() - server.started,
        "tiers": {"cpu": cpu, **_lower_tiers(server)},
        "hits": server.hits.snapshot(),
        # A plan with engine and sidecar ops is tracked by both: count it once.
        "plans_in_flight": len(
            server.engines.plans.keys()
            | (server.dataplane.plans.keys() if server.dataplane else set())
        ),
        "orphaned_plans": len(server.engines.orphans),
        "engines": server.engines.describe(),
        "requests": dict(server.requests),
        "errors": dict(server.errors),
        "expired_sessions": server.engines.num_expired,
        "loop_lapses": server.num_lapses,
    }


def _tier_figures(tier: CacheEngine) -> dict[str, Any]:
    return {
        "capacity_blocks": tier.capacity,
        "used_blocks": tier.mempool.num_used,
        "cached_blocks": tier.index.num_blocks,
        "evicted_blocks": tier.num_evicted_blocks,
    }
