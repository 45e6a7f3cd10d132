"""The figures a running sidecar reports (`kvsidecar stats`, Prometheus):
each part's own, put together in the shape `kvsidecar stats` prints."""

from __future__ import annotations

import gc
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


_SUMMED = ("used_blocks", "cached_blocks", "evicted_blocks")


def realm_figures(handlers: Handlers) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The tiers' figures over every geometry (CPU and SSD block counts
    summed, with bytes; `block_bytes`, `slot_stride` and `slot_bytes` are
    the first geometry's), and each geometry's own. A geometry's CPU and SSD
    `capacity_blocks` is what it holds plus what it may take without taking
    it from another geometry (the unowned extents, at its slot size)."""
    arena = handlers.geometries.arena
    space = handlers.geometries.ssd
    realms = handlers.geometries.realms
    if not realms:
        return {}, []
    geometries: list[dict[str, Any]] = []
    owned = 0
    ssd_owned, ssd_unowned = 0, None
    for layout, realm in realms.items():
        tiers = realm.figures()
        owned += tiers["cpu"]["capacity_blocks"]
        tiers["cpu"]["capacity_blocks"] += arena.unowned_slots(layout.slot_stride)
        ssd_engine = realm.cache.lower.get("ssd")
        if "ssd" in tiers and space is not None and ssd_engine is not None:
            ssd_owned += tiers["ssd"]["capacity_blocks"]
            unowned = space.arena.unowned_slots_for(ssd_engine)
            ssd_unowned = unowned if ssd_unowned is None else ssd_unowned
            tiers["ssd"]["capacity_blocks"] += unowned
            tiers["ssd"]["extents"] = space.arena.extents_of(ssd_engine)
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
    first = geometries[0]["tiers"]
    cpu = dict(first["cpu"])
    for name in _SUMMED:
        cpu[name] = sum(g["tiers"]["cpu"][name] for g in geometries)
    cpu["capacity_blocks"] = owned + arena.unowned_slots(first["cpu"]["slot_stride"])
    for name in ("used", "cached"):
        cpu[f"{name}_bytes"] = sum(
            g["tiers"]["cpu"][f"{name}_blocks"] * g["tiers"]["cpu"]["slot_stride"]
            for g in geometries
        )
    out = {**first, "cpu": cpu}
    with_ssd = [g["tiers"]["ssd"] for g in geometries if "ssd" in g["tiers"]]
    if with_ssd and space is not None:
        ssd = dict(with_ssd[0])
        for name in _SUMMED:
            ssd[name] = sum(t[name] for t in with_ssd)
        ssd["capacity_blocks"] = ssd_owned + (ssd_unowned or 0)
        for name in ("used", "cached"):
            ssd[f"{name}_bytes"] = sum(t[f"{name}_blocks"] * t["slot_bytes"] for t in with_ssd)
        out["ssd"] = {**ssd, **space.arena.figures(), "extent_bytes": space.extent_bytes}
    return out, geometries


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
        # Kept out of the cyclic collector's scans at start (kvsidecar serve).
        "gc_frozen_objects": gc.get_freeze_count(),
    }
