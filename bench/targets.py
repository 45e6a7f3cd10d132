"""The `targets` object of every benchmark's JSON.

`{name: {"value", "limit", "within", "rule"}}`: `within` is None when the
figure was not measured (value None), so a missing figure never reads as
met. `bench control` wrote it first; every benchmark with a target writes
it the same way, so a run's verdict is one lookup:
`all(t["within"] for t in result["targets"].values())`.
"""

from __future__ import annotations

from typing import Any

Target = dict[str, Any]


def at_least(value: float | None, limit: float, rule: str) -> Target:
    """A figure that must be `limit` or more (a speed, a ratio to a floor)."""
    return _target(value, limit, rule, at_most=False)


def at_most(value: float | None, limit: float, rule: str) -> Target:
    """A figure that must be `limit` or less (a time, a size, a gap)."""
    return _target(value, limit, rule, at_most=True)


def _target(value: float | None, limit: float, rule: str, *, at_most: bool) -> Target:
    within = None if value is None else bool(value <= limit if at_most else value >= limit)
    return {"value": value, "limit": limit, "within": within, "rule": rule}


def missed(targets: dict[str, Target]) -> list[str]:
    """Names of the targets not met (unmeasured ones included), in order."""
    return [name for name, t in targets.items() if not t["within"]]


def verdict(targets: dict[str, Target]) -> str:
    """One line for the end of a benchmark's table."""
    names = missed(targets)
    if not names:
        return f"targets: all {len(targets)} met"
    shown = ", ".join(f"{n} {_fmt(targets[n]['value'])}" for n in names[:6])
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    return f"targets: {len(names)} of {len(targets)} not met: {shown}{more}"


def _fmt(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.3g}"
