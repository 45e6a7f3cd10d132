"""What `bench replay` compares: the default policy against the best of
kvsidecar's policies and libCacheSim's algorithms, and Belady's optimum.

The target: at every capacity, the default eviction policy's block hit ratio
is within `TARGET_POINTS` percentage points of the best hit ratio any
compared policy reaches there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TARGET_POINTS = 1.0
TARGET = "default_within_1pt_of_best"
LIVE_TARGET = "live_default_within_1pt_of_best"
PEER_PREFIX = "libcachesim:"

Ratios = Mapping[str, Mapping[int, float]]
"""policy -> capacity -> block hit ratio."""


def candidates(ours: Ratios, peers: Ratios | None) -> dict[str, Mapping[int, float]]:
    """Every compared policy by name; libCacheSim's carry PEER_PREFIX."""
    every = dict(ours)
    every.update({PEER_PREFIX + name: by_c for name, by_c in (peers or {}).items()})
    return every


def best_at(every: Ratios, capacity: int) -> tuple[str, float]:
    """The policy with the highest hit ratio at `capacity` (the first listed on a tie)."""
    name = max(every, key=lambda n: every[n][capacity])
    return name, every[name][capacity]


def default_target(
    default: str,
    ours: Ratios,
    peers: Ratios | None,
    capacities: list[int],
    live: Mapping[int, float] | None = None,
) -> dict[str, Any]:
    """The target's record: worst gap to the best (points), per capacity too.
    With `live`, the default's ratios are those a running sidecar reached
    (`bench replay --live`), against the best replayed."""
    every = candidates(ours, peers)
    measured = ours[default] if live is None else live
    gaps: dict[str, float] = {}
    best: dict[str, str] = {}
    for c in capacities:
        name, value = best_at(every, c)
        gaps[str(c)] = 100.0 * (value - measured[c])
        best[str(c)] = name
    worst = max(gaps.values(), default=0.0)
    compared = "kvsidecar's policies" + (" and libCacheSim's " + ", ".join(peers) if peers else "")
    subject = f"the default policy ({default})" + (" in a running sidecar" if live else "")
    return {
        "value": worst,
        "limit": TARGET_POINTS,
        "rule": f"at every capacity, {subject} within {TARGET_POINTS:g} "
        f"percentage point of the best block hit ratio of {compared}; value = the largest "
        "gap, in points",
        "within": worst <= TARGET_POINTS,
        "gap_points": gaps,
        "best": best,
    }


def comparison_rows(
    default: str,
    ours: Ratios,
    peers: Ratios | None,
    opt: Mapping[int, float],
    capacities: list[int],
    unique: int,
) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows: capacity, opt, the default, the best and who, every peer, the gap."""
    every = candidates(ours, peers)
    headers = ["capacity", "of distinct", "opt", f"default ({default})", "best", "best is"]
    headers += [PEER_PREFIX + p for p in peers or {}]
    headers += ["gap (points)"]
    rows = []
    for c in capacities:
        name, value = best_at(every, c)
        row: list[Any] = [c, f"{c / unique:.1%}", opt[c], ours[default][c], value, name]
        row += [by_c[c] for by_c in (peers or {}).values()]
        row.append(f"{100.0 * (value - ours[default][c]):.2f}")
        rows.append(row)
    return headers, rows
