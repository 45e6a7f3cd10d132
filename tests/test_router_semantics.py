"""The router's hit stats and loads: requests of zero blocks are not recorded
in the sliding hit window; negative loads and more hits than requested blocks
are refused."""

from __future__ import annotations

import pytest

from router.keys import BlockKey, worker
from router.router import Router
from router.stats import RouterStats
from sidecar.control.hits import HitStats
from sidecar.control.plan import TierCounts

W0 = worker(0)


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def ks(*ids: int) -> list[BlockKey]:
    return [k(i) for i in ids]


# ---- hit stats and loads ------------------------------------------------------


def test_zero_block_requests_stay_out_of_the_window() -> None:
    stats = RouterStats(window=3)
    stats.record(W0, 4, 4)
    for _ in range(3):
        stats.record(W0, 0, 0)  # prompts shorter than a block
    figures = stats.snapshot()["all"]
    assert figures["window_hit_ratio"] == 1.0  # type: ignore[index]
    assert figures["window_requests"] == 1 and figures["requests"] == 4  # type: ignore[index]


def test_more_hits_than_requested_blocks_are_refused() -> None:
    stats = HitStats(4)
    with pytest.raises(ValueError, match="hit"):
        stats.record(2, TierCounts(2, 1, 0))
    with pytest.raises(ValueError, match="hit"):
        stats.record(2, TierCounts(-1, 0, 0))
    with pytest.raises(ValueError, match="hit"):
        RouterStats(4).record(W0, 1, 2)
    assert stats.requests == 0


def test_choose_refuses_negative_loads() -> None:
    router = Router("radix")
    router.add_worker(W0)
    with pytest.raises(ValueError, match="loads must be >= 0"):
        router.choose(ks(1), loads={W0: -1})
    assert router.stats.total.requests == 0
