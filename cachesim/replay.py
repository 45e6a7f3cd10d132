"""`kvsidecar bench replay`: block hit ratios of every eviction policy on a trace.

Each request of a Mooncake trace is replayed through the CPU tier's
GlobalCacheEngine as the engine shim would drive it: GET its blocks (and
complete the plan), then PUT them (and complete that plan). The hit ratio is
blocks loaded / blocks looked up. Each capacity is compared with Belady's
optimum at the same capacity and with an unlimited cache, computed in the
same run. The clock is the request index, so a run is deterministic (and
`--hit-reward` is counted in requests, not seconds).

Beside them: the default policy next to the best policy at each capacity,
libCacheSim's algorithms on the same requests (installed on first use into a
side environment; `--no-peers` skips them), and the target that the default
is within 1 point of the best of all of them (`targets` in the JSON).
`--synthetic SHAPE` replays a generated trace instead (cachesim/generate.py).
A trace whose hash ids are not prefix-consistent (an id under two parents)
is refused.

`--live` replays each policy at each capacity once more through a running
sidecar and a KVClient (bench/replay_live.py), and adds the target that the
default policy there is within 1 point of the best replayed. Every block is
copied (4 KiB each): with the committed trace, use `--tokens-per-block 512`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from cachesim import peers
from cachesim.belady import opt_hits
from cachesim.compare import LIVE_TARGET, TARGET, comparison_rows, default_target
from cachesim.generate import DEFAULT_SEED, SHAPES, generate
from cachesim.report import Progress, positive_int, positive_int_list, print_table, write_json
from cachesim.trace import (
    InconsistentTrace,
    Trace,
    check_prefix_consistent,
    infinite_hit_ratio,
    load_mooncake,
)
from contract.ids import BlockKeys, GpuBlockIds, keys_from_ints
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.plan import Plan
from sidecar.control.planner import GlobalCacheEngine
from sidecar.control.policies import DEFAULT_POLICY, POLICY_NAMES

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl"
# Fractions of the trace's distinct blocks. On the conversation trace the
# optimum reaches the unlimited-cache ratio at ~4.5% while the online
# policies need far more, so the sizes span both.
DEFAULT_FRACTIONS = (0.005, 0.01, 0.02, 0.04, 0.1, 0.25)


class LivePass(NamedTuple):
    """One pass through a running sidecar (bench/replay_live.py)."""

    hits: int
    seconds: float
    capacity: int
    """The CPU tier's blocks as the sidecar reported them."""
    policy: dict[str, Any]
    """The tier's policy figures at the end (`auto`: what it follows, switches, chains seen)."""


class LiveReplay(Protocol):
    def __call__(
        self,
        trace: Trace,
        keys: BlockKeys,
        policy: str,
        capacity: int,
        *,
        evict_start_threshold: float,
        evict_ratio: float,
        on_request: Callable[[], None] | None = None,
    ) -> LivePass: ...


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """The `replay` subcommand, returned so that `bench` can add `--live`
    (it needs a sidecar and a client, which this package does not import)."""
    p = subparsers.add_parser(
        "replay",
        help="replay a Mooncake trace through every eviction policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help=f"JSONL trace (default {DEFAULT_TRACE})"
    )
    p.add_argument(
        "--capacities",
        type=_capacities,
        default=None,
        help="CPU-tier sizes in blocks, comma-separated (default: "
        + ", ".join(f"{f:.1%}".replace("%", "%%") for f in DEFAULT_FRACTIONS)
        + " of the trace's distinct blocks)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=POLICY_NAMES,
        help=f"comma-separated (default all: {','.join(POLICY_NAMES)})",
    )
    p.add_argument(
        "--synthetic",
        choices=sorted(SHAPES),
        help="replay a generated trace of this shape instead of --trace "
        "(shapes: cachesim/generate.py)",
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of --synthetic")
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="first N requests only (with --synthetic: N requests)",
    )
    p.add_argument("--no-peers", action="store_true", help="skip the comparison with libCacheSim")
    p.add_argument(
        "--side-envs",
        type=Path,
        default=None,
        help="the folder of side environments (default "
        "$XDG_CACHE_HOME or ~/.cache, then kvsidecar/side-envs); libCacheSim's is libcachesim/",
    )
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--evict-start-threshold", type=float, default=1.0)
    p.add_argument("--evict-ratio", type=float, default=0.0)
    p.add_argument(
        "--hit-reward", type=float, default=0.0, help="lru hit_reward, in requests (default 0)"
    )
    p.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)
    return p


def _capacities(text: str) -> list[int]:
    return sorted(set(positive_int_list(text)))


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or text!r}; allowed: {', '.join(POLICY_NAMES)}"
        )
    return names


def replay(
    trace: Trace,
    keys: BlockKeys,
    policy: str,
    capacity: int,
    *,
    evict_start_threshold: float = 1.0,
    evict_ratio: float = 0.0,
    hit_reward: float = 0.0,
    on_request: Callable[[], None] | None = None,
) -> int:
    """Block hits of one pass; `keys` holds the trace's keys back to back."""
    now = [0.0]
    cpu = CacheEngine(
        "cpu",
        capacity,
        policy=policy,
        evict_start_threshold=evict_start_threshold,
        evict_ratio=evict_ratio,
        hit_reward_seconds=hit_reward,
        clock=lambda: now[0],
    )
    engine = GlobalCacheEngine(cpu)
    offsets = trace.offsets.tolist()
    gpu = GpuBlockIds(np.arange(int(np.diff(trace.offsets).max(initial=0)), dtype=np.int64))
    hits = 0
    for r in range(len(offsets) - 1):
        now[0] = float(r)
        request = BlockKeys(keys[offsets[r] : offsets[r + 1]])
        gpu_blocks = GpuBlockIds(gpu[: request.size])
        cpu.observe(request)  # the request's lookup, as an engine's comes first
        plan = engine.get(request, gpu_blocks)
        hits += plan.hit_blocks.total
        _finish(engine, plan)
        _finish(engine, engine.put(request, gpu_blocks))
        if on_request is not None:
            on_request()
    return hits


def _finish(engine: GlobalCacheEngine, plan: Plan) -> None:
    for op in plan.graph.ops:
        engine.complete(plan.plan_id, op.op_id)


def _load(args: argparse.Namespace) -> tuple[Trace, str] | None:
    """The trace to replay and its name, or None after printing why not."""
    if args.synthetic:
        trace = generate(args.synthetic, args.limit, args.seed, args.tokens_per_block)
        return trace, f"synthetic:{args.synthetic}"
    if not args.trace.is_file():
        print(
            f"error: trace not found: {args.trace}\n"
            "Pass --trace PATH to a Mooncake-format JSONL trace.",
            file=sys.stderr,
        )
        return None
    trace = load_mooncake(args.trace, args.tokens_per_block, args.limit)
    try:
        check_prefix_consistent(trace)
    except InconsistentTrace as exc:
        print(f"error: {args.trace}: {exc}", file=sys.stderr)
        return None
    return trace, args.trace.name


def run(args: argparse.Namespace, live: LiveReplay | None = None) -> int:
    """The replay; with `live` and `args.live`, the live passes too."""
    loaded = _load(args)
    if loaded is None:
        return 2
    trace, trace_name = loaded
    side_python = None
    if not args.no_peers:
        try:
            side_python = peers.ensure_side_env(args.side_envs)
        except peers.PeerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    unique = trace.num_unique_blocks()
    capacities = args.capacities or sorted({max(1, round(f * unique)) for f in DEFAULT_FRACTIONS})
    policies = tuple(dict.fromkeys((DEFAULT_POLICY, *args.policies)))
    result = _replay_all(args, trace, capacities, policies)
    result.update(trace=trace_name, seed=args.seed if args.synthetic else None)
    peer_ratio = None
    if side_python is not None:
        try:
            found = peers.peer_hits(side_python, trace, capacities)
        except peers.PeerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        lookups = max(trace.num_lookups, 1)
        peer_ratio = {
            p: {c: h / lookups for c, h in by_c.items()} for p, by_c in found.hits.items()
        }
        result["libcachesim_version"] = found.version
        result["peer_hit_ratio"] = _by_str(peer_ratio)
        result["peer_pass_seconds"] = _by_str(found.seconds)
    ours = {p: {int(c): v for c, v in by_c.items()} for p, by_c in result["hit_ratio"].items()}
    opt = {int(c): v for c, v in result["opt_hit_ratio"].items()}
    result["default_policy"] = DEFAULT_POLICY
    result["targets"] = {TARGET: default_target(DEFAULT_POLICY, ours, peer_ratio, capacities)}
    live = live if getattr(args, "live", False) else None
    if live is not None:
        try:
            result.update(_replay_live(args, trace, capacities, policies, live))
        except (ValueError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        measured = {int(c): v for c, v in result["live_hit_ratio"][DEFAULT_POLICY].items()}
        result["targets"][LIVE_TARGET] = default_target(
            DEFAULT_POLICY, ours, peer_ratio, capacities, measured
        )
    _print(result, capacities, policies, unique)
    print()
    print_table(*comparison_rows(DEFAULT_POLICY, ours, peer_ratio, opt, capacities, unique))
    if live is not None:
        print()
        _print_live(result, capacities, policies)
    for name, target in result["targets"].items():
        print(
            f"target {name}: largest gap {target['value']:.2f} points "
            f"(limit {target['limit']:g}): {'met' if target['within'] else 'NOT met'}"
        )
    if args.json:
        write_json(args.json, result)
    return 0


def _by_str(table: dict[str, dict[int, Any]]) -> dict[str, dict[str, Any]]:
    return {p: {str(c): v for c, v in by_c.items()} for p, by_c in table.items()}


def _replay_all(
    args: argparse.Namespace, trace: Trace, capacities: list[int], policies: tuple[str, ...]
) -> dict[str, Any]:
    """kvsidecar's policies and Belady's optimum at every capacity."""
    keys = keys_from_ints(trace.block_ids)
    lookups = trace.num_lookups
    opt: dict[int, float] = {}
    start = time.perf_counter()
    for c in capacities:
        opt[c] = opt_hits(trace, c) / lookups if lookups else 0.0
    belady_s = (time.perf_counter() - start) / len(capacities)

    hit_ratio: dict[str, dict[int, float]] = {p: {} for p in policies}
    seconds: dict[str, dict[int, float]] = {p: {} for p in policies}
    passes = len(policies) * len(capacities)
    with Progress(passes * trace.num_requests, "replay", force=args.progress) as bar:
        for policy in policies:
            for c in capacities:
                bar.label = f"{policy:>6} @ {c:,}"
                start = time.perf_counter()
                hits = replay(
                    trace,
                    keys,
                    policy,
                    c,
                    evict_start_threshold=args.evict_start_threshold,
                    evict_ratio=args.evict_ratio,
                    hit_reward=args.hit_reward,
                    on_request=bar.update,
                )
                seconds[policy][c] = time.perf_counter() - start
                hit_ratio[policy][c] = hits / lookups if lookups else 0.0

    return {
        "hit_ratio": _by_str(hit_ratio),
        "opt_hit_ratio": {str(c): v for c, v in opt.items()},
        "infinite_hit_ratio": infinite_hit_ratio(trace),
        "seconds_per_pass": statistics.median(
            s for by_c in seconds.values() for s in by_c.values()
        ),
        "pass_seconds": _by_str(seconds),
        "belady_seconds_per_capacity": belady_s,
        "block_lookups": lookups,
        "unique_blocks": trace.num_unique_blocks(),
        "requests": trace.num_requests,
        "tokens_per_block": trace.tokens_per_block,
        "capacities": capacities,
        "policies": list(policies),
        "evict_start_threshold": args.evict_start_threshold,
        "evict_ratio": args.evict_ratio,
        "hit_reward_requests": args.hit_reward,
    }


def _replay_live(
    args: argparse.Namespace,
    trace: Trace,
    capacities: list[int],
    policies: tuple[str, ...],
    live_pass: LiveReplay,
) -> dict[str, Any]:
    """Every policy at every capacity through a running sidecar."""
    keys = keys_from_ints(trace.block_ids)
    lookups = max(trace.num_lookups, 1)
    ratio: dict[str, dict[int, float]] = {p: {} for p in policies}
    seconds: dict[str, dict[int, float]] = {p: {} for p in policies}
    figures: dict[str, dict[int, Any]] = {p: {} for p in policies}
    passes = len(policies) * len(capacities)
    with Progress(passes * trace.num_requests, "live", force=args.progress) as bar:
        for policy in policies:
            for c in capacities:
                bar.label = f"live {policy:>6} @ {c:,}"
                done = live_pass(
                    trace,
                    keys,
                    policy,
                    c,
                    evict_start_threshold=args.evict_start_threshold,
                    evict_ratio=args.evict_ratio,
                    on_request=bar.update,
                )
                if done.capacity != c:
                    raise RuntimeError(f"the live sidecar holds {done.capacity} blocks, not {c}")
                ratio[policy][c] = done.hits / lookups
                seconds[policy][c] = done.seconds
                figures[policy][c] = done.policy
    return {
        "live_hit_ratio": _by_str(ratio),
        "live_pass_seconds": _by_str(seconds),
        "live_policy_figures": _by_str(figures),
    }


def _print_live(result: dict[str, Any], capacities: list[int], policies: tuple[str, ...]) -> None:
    """Each policy's hit ratio replayed and in a running sidecar, side by side."""
    rows = []
    for c in capacities:
        row: list[Any] = [c]
        for p in policies:
            row += [result["hit_ratio"][p][str(c)], result["live_hit_ratio"][p][str(c)]]
        rows.append(row)
    print_table(["capacity", *(f"{p} {how}" for p in policies for how in ("replay", "live"))], rows)


def _print(
    result: dict[str, Any], capacities: list[int], policies: tuple[str, ...], unique: int
) -> None:
    print(
        f"{result['requests']:,} requests, {result['block_lookups']:,} block lookups of "
        f"{result['tokens_per_block']} tokens, {unique:,} distinct blocks; "
        f"{result['seconds_per_pass']:.1f} s per pass (median), "
        f"Belady {result['belady_seconds_per_capacity']:.2f} s per capacity"
    )
    rows = []
    for c in capacities:
        opt = result["opt_hit_ratio"][str(c)]
        row: list[Any] = [c, f"{c / unique:.1%}", result["infinite_hit_ratio"], opt]
        row += [result["hit_ratio"][p][str(c)] for p in policies]
        best = max(result["hit_ratio"][p][str(c)] for p in policies)
        row.append(f"{best / opt:.1%}" if opt else "-")
        rows.append(row)
    headers = ["capacity", "of distinct", "infinite", "opt", *policies, "best/opt"]
    print_table(headers, rows)
