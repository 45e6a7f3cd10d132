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
    tiers = handlers.tiers.figures() if handlers.tiers is not None else {}
    return {
        "instance": instance,
        "endpoint": endpoint,
        "pid": os.getpid(),
        "boot_id": boot_id,
        "uptime_seconds": time.time() - started,
        "tiers": {"cpu": {**pool_figures(pool, capacity), **tiers.pop("cpu", {})}, **tiers},
        **handlers.figures(),
        "loop_lapses": num_lapses,
    }
