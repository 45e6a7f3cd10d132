"""The figures a running sidecar reports (`kvsidecar stats`, Prometheus):
each part's own, put together in the shape `kvsidecar stats` prints."""

from __future__ import annotations

import os
import time
from typing import Any

from shm.pool import ShmPool
from sidecar.server.handlers import Handlers


def pool_figures(pool: ShmPool, capacity: int) -> dict[str, Any]:
    return {
        "capacity_bytes": capacity,
        "prefault_seconds": pool.prefault_seconds,
        "segments": len(pool.segment_names),
        "directory": pool.directory or "/dev/shm",
        "page_kind": pool.page_kind,
        "huge_bytes": pool.pages.huge_bytes,
    }


_SUMMED = ("capacity_blocks", "used_blocks", "cached_blocks", "evicted_blocks")


def realm_figures(handlers: Handlers) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The tiers' figures over every geometry (CPU block counts summed, with
    bytes; `block_bytes` and `slot_stride` are the first geometry's, like
    the SSD and remote tiers, which only it has), and each geometry's own."""
    geometries = []
    arena = handlers.geometries.arena
    for layout, realm in handlers.geometries.realms.items():
        tiers = realm.figures()
        # What it holds, and what it may take without taking it from another geometry:
        tiers["cpu"]["capacity_blocks"] += arena.unowned_slots(layout.slot_stride)
        geometries.append(
            {
                "num_layers": layout.num_layers,
                "layer_block_bytes": layout.layer_block_bytes,
                "tp_size": layout.tp_size,
                "extents": arena.extents_of(realm.cache.cpu),
                "engines": sorted(
                    g.engine_id for g in handlers.engines.groups.values() if g.realm is realm
                ),
                "tiers": tiers,
            }
        )
    if not geometries:
        return {}, []
    first = geometries[0]["tiers"]
    cpu = dict(first["cpu"])
    for name in _SUMMED:
        cpu[name] = sum(g["tiers"]["cpu"][name] for g in geometries)
    # The unowned extents count once, at the first geometry's stride:
    later = list(handlers.geometries.realms)[1:]
    cpu["capacity_blocks"] -= sum(arena.unowned_slots(layout.slot_stride) for layout in later)
    for name in ("used", "cached"):
        cpu[f"{name}_bytes"] = sum(
            g["tiers"]["cpu"][f"{name}_blocks"] * g["tiers"]["cpu"]["slot_stride"]
            for g in geometries
        )
    return {**first, "cpu": cpu}, geometries


def server_figures(
    *,
    instance: str,
    endpoint: str,
    boot_id: str,
    started: float,
    capacity: int,
    pool: ShmPool,
    handlers: Handlers,
    num_lapses: int,
) -> dict[str, Any]:
    """Every figure `kvsidecar stats` prints and the metrics endpoint exports."""
    tiers, geometries = realm_figures(handlers)
    arena = handlers.geometries.arena.figures()
    cpu = {**pool_figures(pool, capacity), **arena, **tiers.pop("cpu", {})}
    return {
        "instance": instance,
        "endpoint": endpoint,
        "pid": os.getpid(),
        "boot_id": boot_id,
        "uptime_seconds": time.time() - started,
        "tiers": {"cpu": cpu, **tiers},
        "geometries": geometries,
        "namespaces": handlers.namespaces.figures(handlers.geometries),
        **handlers.figures(),
        "loop_lapses": num_lapses,
    }
