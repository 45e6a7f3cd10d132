"""`kvsidecar analyze TRACE`: how much prefix reuse a trace holds.

Prints the hit ratio of an unlimited prefix cache, per-request statistics of
the cached prefix length, the reuse distribution of blocks, and the hit ratio
of every eviction policy at several cache sizes (replayed through the CPU
tier's cache engine, as `kvsidecar bench replay` does, with Belady's optimum
next to them), and draws the last as a PNG (with matplotlib: the `analyze`
extra). Progress goes to stderr: a bar on a terminal, else a line every few
seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cachesim.belady import opt_hits
from cachesim.replay import DEFAULT_FRACTIONS, replay
from cachesim.report import Progress, positive_int, print_table, write_json
from cachesim.trace import Trace, infinite_hit_ratio, load_mooncake, request_index
from contract.ids import keys_from_ints
from sidecar.control.policies import POLICY_NAMES

REUSE_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64), (65, None))
PROGRESS_EVERY = 5.0
"""Seconds between progress lines when stderr is not a terminal."""
NO_MATPLOTLIB = (
    "kvsidecar analyze: --png needs matplotlib: pip install 'kvsidecar[analyze]' "
    "(or run without --png for the tables only)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("trace", type=Path, help="Mooncake-format JSONL trace")
    p.add_argument(
        "--png",
        type=Path,
        help="write the hit ratio vs cache size plot here (needs matplotlib: "
        "pip install 'kvsidecar[analyze]')",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument(
        "--limit", type=positive_int, default=None, metavar="N", help="first N requests only"
    )
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument(
        "--fractions",
        default=",".join(str(f) for f in DEFAULT_FRACTIONS),
        help="cache sizes as fractions of the distinct blocks, comma-separated",
    )
    p.set_defaults(func=run)


def prefix_hits(trace: Trace) -> np.ndarray:
    """Per request, the leading blocks an unlimited prefix cache would hold."""
    ids = trace.block_ids
    if ids.size == 0:
        return np.zeros(trace.num_requests, dtype=np.int64)
    req = request_index(trace.offsets)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    hit = req[first][inverse.reshape(-1)] < req
    return np.bincount(req, weights=hit, minlength=trace.num_requests).astype(np.int64)


def reuse_distribution(trace: Trace) -> dict[str, float]:
    """Share of distinct blocks by how many requests look them up."""
    _, counts = np.unique(trace.block_ids, return_counts=True)
    out = {}
    for low, high in REUSE_BUCKETS:
        sel = counts >= low if high is None else (counts >= low) & (counts <= high)
        label = f"{low}+" if high is None else (str(low) if low == high else f"{low}-{high}")
        out[label] = float(sel.mean()) if counts.size else 0.0
    return out


def _quantiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    q = np.percentile(values, [50, 90, 99])
    return {
        "mean": float(values.mean()),
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": float(values.max()),
    }


def policy_curves(
    trace: Trace, capacities: list[int], on_step: Callable[[], None] | None = None
) -> dict[str, dict[int, float]]:
    """Hit ratio per policy per capacity, plus "opt" (Belady); `on_step` is
    called after each of the (policies + 1) x capacities replays."""
    keys = keys_from_ints(trace.block_ids)
    lookups = max(trace.num_lookups, 1)
    curves: dict[str, dict[int, float]] = {}
    for policy in (*POLICY_NAMES, "opt"):
        curves[policy] = {}
        for c in capacities:
            hits = opt_hits(trace, c) if policy == "opt" else replay(trace, keys, policy, c)
            curves[policy][c] = hits / lookups
            if on_step is not None:
                on_step()
    return curves


def analyze(trace: Trace, fractions: list[float]) -> dict[str, Any]:
    unique = trace.num_unique_blocks()
    capacities = sorted({max(1, round(f * unique)) for f in fractions})
    hits = prefix_hits(trace)
    lengths = np.diff(trace.offsets)
    steps = (len(POLICY_NAMES) + 1) * len(capacities)
    with Progress(steps, "analyze: policy curves", lines_every=PROGRESS_EVERY) as bar:
        curves = policy_curves(trace, capacities, bar.update)
    return {
        "requests": trace.num_requests,
        "block_lookups": trace.num_lookups,
        "unique_blocks": unique,
        "tokens_per_block": trace.tokens_per_block,
        "infinite_hit_ratio": infinite_hit_ratio(trace),
        "requests_with_a_hit": float((hits > 0).mean()) if hits.size else 0.0,
        "prefix_blocks": _quantiles(hits),
        "request_blocks": _quantiles(lengths),
        "reuse_distribution": reuse_distribution(trace),
        "capacities": capacities,
        "hit_ratio": {p: {str(c): v for c, v in by_c.items()} for p, by_c in curves.items()},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = result["capacities"]
    for policy, by_c in result["hit_ratio"].items():
        style: dict[str, Any] = (
            {"linestyle": "--", "color": "black"} if policy == "opt" else {"marker": "o"}
        )
        ax.plot(caps, [by_c[str(c)] for c in caps], label=policy, **style)
    ax.axhline(result["infinite_hit_ratio"], color="grey", linestyle=":", label="unlimited")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(f"cache size (blocks of {result['tokens_per_block']} tokens)")
    ax.set_ylabel("block hit ratio")
    ax.set_title(f"{result['requests']:,} requests, {result['unique_blocks']:,} distinct blocks")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
        if not fractions or any(not 0 < f <= 1 for f in fractions):
            raise ValueError("--fractions must be numbers in (0, 1]")
        if args.png and not _has_matplotlib():
            print(NO_MATPLOTLIB, file=sys.stderr)  # before minutes of work, not after
            return 2
        print(f"analyze: loading {args.trace}", file=sys.stderr, flush=True)
        trace = load_mooncake(args.trace, args.tokens_per_block, args.limit)
    except (OSError, ValueError) as exc:
        print(f"kvsidecar analyze: {exc}", file=sys.stderr)
        return 2
    result = analyze(trace, fractions)
    _print(result)
    if args.png:
        plot(result, args.png)
        print(f"plot: {args.png}")
    if args.json:
        write_json(args.json, result)
    return 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _print(r: dict[str, Any]) -> None:
    print(
        f"{r['requests']:,} requests, {r['block_lookups']:,} block lookups of "
        f"{r['tokens_per_block']} tokens, {r['unique_blocks']:,} distinct blocks"
    )
    print(
        f"unlimited-cache hit ratio {r['infinite_hit_ratio']:.3f}; "
        f"{r['requests_with_a_hit']:.1%} of requests reuse a prefix"
    )
    stats = ("mean", "p50", "p90", "p99", "max")
    print_table(
        ["blocks per request", *stats],
        [
            ["cached prefix", *(r["prefix_blocks"][s] for s in stats)],
            ["whole request", *(r["request_blocks"][s] for s in stats)],
        ],
    )
    reuse = r["reuse_distribution"]
    print_table(["requests using a block", *reuse], [["share of blocks", *reuse.values()]])
    policies = list(r["hit_ratio"])
    rows = [[c, *(r["hit_ratio"][p][str(c)] for p in policies)] for c in r["capacities"]]
    print_table(["capacity", *policies], rows)
