"""Each tier's index and eviction policy, built from the one set of settings."""

from __future__ import annotations

from sidecar.config import Config
from sidecar.control.cache_engine import CacheEngine


def tier_engine(
    name: str, num_slots: int, config: Config, *, record_events: bool = False
) -> CacheEngine:
    """A tier's CacheEngine with the configured policy and its settings
    (`eviction_policy`, `evict_start_threshold`, `evict_ratio`,
    `hit_reward_seconds`): every tier gets all of them (the remote tier's
    index once went without `hit_reward_seconds`)."""
    return CacheEngine(
        name,
        num_slots,
        config.eviction_policy,
        config.evict_start_threshold,
        config.evict_ratio,
        config.hit_reward_seconds,
        record_events=record_events,
    )
