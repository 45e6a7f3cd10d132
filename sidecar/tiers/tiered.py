"""TieredCache: the cache of one block layout, every tier of it built whole.

The tiers are sized by the block layout (slots of `slot_stride` bytes), which
the first engine to register brings; `sidecar.tiers.build.open_tiered_cache`
builds all of them at once: the control plane's `GlobalCacheEngine`, the SSD store and its I/O
pool, the remote tier, and the data plane that runs their ops of each plan.
A tier the configuration leaves out (or that cannot be opened, logged) is
None here, and stays so for the sidecar's life.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from shm.layout import BlockLayout
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.planner import GlobalCacheEngine
from sidecar.tiers.dataplane import DataPlane
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.remote.tier import RemoteTier
from sidecar.tiers.ssd.store import SsdStore

log = logging.getLogger("kvsidecar")


@dataclass
class TieredCache:
    layout: BlockLayout
    cache: GlobalCacheEngine
    ssd: SsdStore | None
    io: IoPool | None
    """The SSD tier's I/O pool (with `ssd`)."""
    remote: RemoteTier | None
    dataplane: DataPlane | None
    """Runs the SSD and remote ops of plans; None without lower tiers."""

    @property
    def fds(self) -> list[int]:
        """Event fds the control loop waits on beside its socket: results of
        the I/O pools, and of remote probes and pings."""
        fds = [io.fd for io in self.dataplane.pools] if self.dataplane is not None else []
        return fds + ([self.remote.control_pool.fd] if self.remote is not None else [])

    def collect(self, ready: Container[int]) -> None:
        """Apply the results of the pools whose fds are `ready`."""
        if self.dataplane is not None:
            for io in self.dataplane.pools:
                if io.fd in ready:
                    self.dataplane.collect(io)
        if self.remote is not None:
            if self.remote.control_pool.fd in ready:
                self.remote.collect()
            self.remote.tick()

    def adopt_background(self) -> None:
        """Write-backs created by CPU evictions go to the I/O pools."""
        if self.dataplane is not None:
            for plan in self.cache.drain_background():
                self.dataplane.adopt(plan)

    def claim_recovered(self, ns: int, tag: bytes) -> int:
        """Give namespace `ns` (tagged `tag`) the trees the SSD tier recovered
        as its own at start, aged from when they were written (their TTL
        counts from then); returns their blocks. The trees a request of
        theirs extended meanwhile have been claimed already."""
        trees = None if self.ssd is None else self.ssd.recovered.pop(tag, None)
        if not trees:
            return 0
        index = self.cache.lower["ssd"].index
        now_ms = time.time_ns() // 1_000_000
        claimed = 0
        for first, written_ms in trees.items():
            top = index.root.children.get(first)
            if top is not None and top.ns == 0:  # not evicted, nor extended meanwhile
                claimed += index.claim(top, ns, (now_ms - written_ms) / 1000)
        return claimed

    def cancel(self, plan_id: int) -> None:
        """Roll a plan back (at once, or when its ops on I/O threads return)."""
        if self.dataplane is not None:
            self.dataplane.cancel(plan_id)
        else:
            self.cache.cancel(plan_id)

    def busy(self) -> bool:
        """Sidecar-side ops or remote probes are in flight."""
        probes = self.remote.pending_probes if self.remote is not None else 0
        return bool((self.dataplane is not None and self.dataplane.plans) or probes)

    def plan_ids(self) -> set[int]:
        return set(self.dataplane.plans) if self.dataplane is not None else set()

    def abandon(self) -> None:
        """Shutting down: forget probes and the plans still on I/O threads."""
        if self.remote is not None:
            self.remote.abandon_probes()
        if self.dataplane is not None:
            self.dataplane.abandon()

    def close(self) -> None:
        """Stop the I/O threads (they may still read or write shm slots) and
        close the remote store (idempotent). The SSD store belongs to the
        `SsdSpace`, which closes it after this."""
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def figures(self) -> dict[str, dict[str, Any]]:
        """Per tier: `cpu` (what the index and mempool say), `ssd`, `remote`."""
        out = {
            "cpu": {
                **tier_figures(self.cache.cpu),
                "block_bytes": self.layout.block_bytes,
                "slot_stride": self.layout.slot_stride,
            }
        }
        ssd_tier = self.cache.lower.get("ssd")
        if ssd_tier is not None and self.ssd is not None:
            ops = self.dataplane.tiers.get("ssd") if self.dataplane is not None else None
            counters = ops.counters if ops is not None else {}
            latency = ops.latency if ops is not None else {}
            out["ssd"] = {
                **tier_figures(ssd_tier),
                "slot_bytes": self.ssd.slot_bytes,
                "direct_io": self.ssd.direct,
                "checksum_failures": counters.get("checksum_failures", 0),
                "io_errors": counters.get("io_errors", 0),
                "ops_in_flight": self.io.in_flight if self.io is not None else 0,
                "latency": {kind: h.figures() for kind, h in latency.items()},
            }
        remote_tier = self.cache.lower.get("remote")
        if remote_tier is not None and self.remote is not None:
            out["remote"] = {**tier_figures(remote_tier), **self.remote.figures()}
        return out


def tier_figures(tier: CacheEngine) -> dict[str, Any]:
    return {
        "capacity_blocks": tier.capacity,
        "used_blocks": tier.mempool.num_used,
        "cached_blocks": tier.index.num_blocks,
        "evicted_blocks": tier.num_evicted_blocks,
        "policy": tier.policy_figures(),
    }
