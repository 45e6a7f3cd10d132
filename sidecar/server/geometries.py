"""Every block geometry the sidecar serves: a cache each, one CPU arena.

A geometry is a block layout (layers, bytes of a layer's block, TP size).
The first engine of a geometry to register brings its cache (`TieredCache`:
index, policy, plans, and the tiers below the CPU one); their CPU tiers
share the shm pool through one `ExtentArena`, which moves whole extents
between geometries as their data gets hotter or colder, and their SSD tiers
share the SSD budget through another (`SsdSpace`; docs/sidecar.md, "Many
models on one sidecar").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np

from shm.layout import BlockLayout
from shm.pool import ShmPool
from shm.segments import SEGMENT_MODE
from sidecar.config import Config, group_id
from sidecar.control.arena import ExtentArena
from sidecar.runtime import SHARED_READ_MODE, instance_paths
from sidecar.server.hotpath import HotIndexes
from sidecar.tiers.build import open_tiered_cache
from sidecar.tiers.ssd.space import SsdSpace
from sidecar.tiers.tiered import TieredCache

log = logging.getLogger("kvsidecar")


class Geometries:
    def __init__(
        self,
        config: Config,
        pool: ShmPool,
        on_plan_ended: Callable[[int, bool], None],
        watch: Callable[[int], None],
    ) -> None:
        """`on_plan_ended(plan_id, ok)`: a plan a data plane ran ended;
        `watch(fd)`: wake the loop when an I/O pool's fd is readable."""
        self.config = config
        self.pool = pool
        self._on_plan_ended = on_plan_ended
        self._watch = watch
        self.realms: dict[BlockLayout, TieredCache] = {}
        """Per geometry, its cache."""
        self.arena = ExtentArena(pool.segment_sizes, self._move_blocks)
        self.ssd: SsdSpace | None = None
        """Every geometry's SSD tier (those found on disk opened at start)."""
        if config.ssd_dirs:
            try:
                self.ssd = SsdSpace(config)
            except (OSError, ValueError) as err:
                log.error("SSD tier disabled: %s", err)
        gid = group_id(config.group)
        self.hot = HotIndexes(
            instance_paths(config).shm_prefix,
            SEGMENT_MODE if gid is None else SHARED_READ_MODE,
            gid,
            config.write_policy,
        )
        """What engines map to look up and load without a round trip."""

    def __iter__(self) -> Iterator[TieredCache]:
        return iter(self.realms.values())

    def cache_of(self, layout: BlockLayout) -> TieredCache:
        """The geometry's cache, built on first use. Raises ProtocolError
        (LAYOUT_MISMATCH), having changed nothing, if its blocks do not fit
        an extent of the CPU tier."""
        realm = self.realms.get(layout)
        if realm is None:
            # A geometry the CPU tier refuses (below) opens no SSD store first.
            fits = self.arena.fits(layout.slot_stride)
            ssd = self.ssd.tier(layout) if self.ssd is not None and fits else None
            realm = open_tiered_cache(
                self.config, self.pool, layout, self._on_plan_ended, self.arena, ssd
            )
            self.realms[layout] = realm
            self.hot.add(realm, layout, self.slots_of(layout))
            for fd in realm.fds:  # results wake the loop through their eventfds
                self._watch(fd)
        return realm

    def slots_of(self, layout: BlockLayout) -> int:
        """Slots of the geometry's stride in the whole CPU tier: the range of
        slot numbers its engines may be given."""
        return self.arena.space(layout.slot_stride)

    def plan_ids(self) -> set[int]:
        plans: set[int] = set()
        for realm in self.realms.values():
            plans |= realm.plan_ids()
        return plans

    def adopt_background(self) -> None:
        """Write-backs created by CPU evictions go to the I/O pools."""
        for realm in self.realms.values():
            realm.adopt_background()

    def expire(self) -> None:
        """Drop the blocks past their namespace's TTL that nothing holds."""
        for realm in self.realms.values():
            realm.cache.expire()

    def close(self) -> None:
        """Close every geometry's tiers (their I/O threads first; idempotent)
        and withdraw the hot indexes."""
        self.hot.close()
        for realm in self.realms.values():
            realm.close()
        if self.ssd is not None:
            self.ssd.close()

    def _move_blocks(self, stride: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy CPU slots (an extent changing geometry: `ExtentArena`)."""
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            np.copyto(self.pool.slot_view(d, stride), self.pool.slot_view(s, stride))
        self.hot.move(stride, src, dst)
