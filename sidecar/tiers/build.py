"""Building the tiers (a `TieredCache`) when the block layout is known."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import redis

from contract.protocol import ErrorCode, ProtocolError
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.config import Config, ConfigError
from sidecar.control.admission import DoubleGetRule
from sidecar.control.arena import ExtentArena
from sidecar.control.planner import GlobalCacheEngine
from sidecar.tiers.dataplane import DataPlane, TierOps
from sidecar.tiers.engines import tier_engine
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.remote.redis import RedisConnector
from sidecar.tiers.remote.store import RemoteStore
from sidecar.tiers.remote.tier import Backoff, RemoteTier
from sidecar.tiers.remote.value_check import read_secret
from sidecar.tiers.ssd.ops import SsdOps
from sidecar.tiers.ssd.space import SsdTier
from sidecar.tiers.tiered import TieredCache

log = logging.getLogger("kvsidecar")


REMOTE_INDEX_MAX_BLOCKS = 1 << 20
"""The remote index is a cache of what this sidecar knows the store holds;
past this many blocks it forgets (evicts) the coldest."""


def open_tiered_cache(
    config: Config,
    pool: ShmPool,
    layout: BlockLayout,
    on_plan_ended: Callable[[int, bool], None],
    arena: ExtentArena,
    ssd: SsdTier | None,
) -> TieredCache:
    """Every tier for blocks of `layout` (a geometry an engine brought), and
    the data plane that runs their ops; `on_plan_ended(plan_id, ok)` is
    called when a plan the data plane ran ends. Its CPU tier joins the
    `arena` the geometries share; `ssd` is its SSD tier, if it has one
    (`sidecar.tiers.ssd.space`).
    Raises ProtocolError (LAYOUT_MISMATCH) if a block does not fit an
    extent of the CPU tier."""
    c = config
    cpu = tier_engine("cpu", 0, c, record_events=c.events_endpoint is not None)
    try:
        arena.join(cpu, layout.slot_stride)
    except ValueError as err:
        raise ProtocolError(
            ErrorCode.LAYOUT_MISMATCH, f"{err}: raise cpu_extent_size (or cpu_capacity)"
        ) from None
    log.info(
        "CPU tier: geometry %s, slots of %d bytes, %d in the arena",
        layout,
        layout.slot_stride,
        arena.space(layout.slot_stride),
    )
    ssd_engine, store, io = None, None, None
    if ssd is not None:
        ssd_engine, store = ssd
        io = IoPool("ssd", c.ssd_io_threads)
    remote_engine = None
    if c.remote_url is not None:
        num = min(c.remote_capacity // layout.slot_stride, REMOTE_INDEX_MAX_BLOCKS)
        remote_engine = tier_engine("remote", num, c)
    cache = GlobalCacheEngine(
        cpu,
        ssd_engine,
        remote_engine,
        c.write_policy,
        c.write_through_min_hits,
        DoubleGetRule(c.remote_double_get_min_blocks, c.remote_double_get_min_share),
        c.remote_put_quota_blocks,
        # Plan ids start anywhere in 62 bits: an id held by an engine from
        # before a restart names no plan of this boot.
        first_plan_id=1 + secrets.randbits(62),
    )
    remote = open_remote_tier(c, cache, pool, layout) if remote_engine is not None else None
    if remote_engine is not None and remote is None:
        cache.set_online("remote", False)
    ops: list[TierOps] = []
    if store is not None and io is not None:
        ops.append(SsdOps(store, io, pool, layout))
    if remote is not None:
        ops.append(remote.ops)
    dataplane = DataPlane(cache, pool, layout, ops, on_plan_ended) if ops else None
    return TieredCache(layout, cache, store, io, remote, dataplane)


def open_remote_tier(
    config: Config, cache: GlobalCacheEngine, pool: ShmPool, layout: BlockLayout
) -> RemoteTier | None:
    """The remote tier's store and worker pool; None (logged) when its URL
    cannot be used. Connections are made on first use: a store that is down
    at start only marks the tier unavailable."""
    assert config.remote_url is not None
    try:
        connector = RedisConnector(
            config.remote_url,
            timeout=config.remote_timeout_seconds,
            cluster=config.remote_cluster,
            max_connections=4 * config.remote_io_threads,
        )
    except (ValueError, redis.RedisError) as err:
        log.error("remote tier disabled: remote_url cannot be used: %s", err)
        return None
    try:  # checked at start; read again now, as the tier is built
        secret = read_secret(config.remote_secret_file) if config.remote_secret_file else None
    except ConfigError as err:
        connector.close()
        log.error("remote tier disabled: %s", err)
        return None
    store = RemoteStore(connector, config.remote_namespace, layout.block_bytes, secret)
    backoff = Backoff(config.remote_retry_seconds, config.remote_retry_max_seconds)
    tier = RemoteTier(
        cache,
        store,
        config.remote_io_threads,
        pool,
        layout,
        backoff,
        write_streams=config.remote_write_streams,
    )
    log.info(
        "remote tier: %s, namespace %r, index of %d blocks, values checked by %s",
        connector.describe(),
        config.remote_namespace,
        cache.lower["remote"].capacity,
        "a MAC" if secret is not None else "a checksum only",
    )
    return tier
