"""`kvsidecar bench router`: the cluster router replaying the Mooncake trace.

A simulated fleet of N workers, each a CPU-tier cache engine of the sidecar
(LRU, `--capacity` blocks each, recording KV events). Every request is routed
either by the router (lowest cost: blocks still to prefill + the worker's
in-flight load) or round robin; the chosen worker then serves it (GET: hits
counted, then PUT) and its drained KV events are applied to the router's
index, as a subscriber would. The hit ratio is blocks served from the chosen
worker's cache / blocks looked up.

In-flight load: the blocks of each worker's requests among the last
`--inflight` x N requests stand in for its decode load, so that routing by
overlap alone cannot pile every request onto one worker.

Timed, per index implementation: applying events (events/s and blocks/s),
`find_matches` per request (p50/p99), and at the end removing the worker
holding most blocks (the call, then the longest and the total of the sweep
slices that drop its entries: the total is what an eager removal costs).
The floor of `find_matches`, measured in the same run on the same requests:
a plain dict walked over the request's keys until the first key no worker
holds (the lookups any index must at least do). Routing by overlap is
deterministic, so every index (native, radix, flat) must give the same hit
ratio: the run checks it.

Then, unless `--no-peers`, the side by side with NVIDIA Dynamo's indexer
(bench/router_dynamo.py): the first `--peer-requests` requests at
`--peer-workers` workers recorded as KV events and replayed into Dynamo's
RadixTree (in its side environment, installed on first use) and into each
of ours, scores asserted identical, with the targets of issue 31.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from cachesim.replay import DEFAULT_TRACE, _finish
from cachesim.report import positive_int, positive_int_list, print_table, write_json
from cachesim.trace import Trace, infinite_hit_ratio, load_mooncake
from contract.events import Cleared, Removed, RouterEvent, Stored
from contract.ids import BlockKeys, keys_from_ints
from router.index import default_index
from router.keys import BlockKey, Worker, split_keys, worker
from router.router import Router
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.events import AllBlocksCleared, BlockRemoved, KVEvent
from sidecar.control.planner import GlobalCacheEngine

INDEXES = ("native", "radix", "flat") if default_index() == "native" else ("radix", "flat")
"""The indexes measured (native only where its C extension is built)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "router",
        help="route the Mooncake trace over a simulated fleet: overlap vs round robin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument(
        "--limit", type=positive_int, default=None, metavar="N", help="first N requests only"
    )
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--workers", type=positive_int_list, default=[8, 64], help="fleet sizes")
    p.add_argument(
        "--capacity",
        type=float,
        default=0.02,
        help="blocks per worker, as a share of the trace's distinct blocks (default 0.02)",
    )
    p.add_argument("--inflight", type=int, default=2, help="in-flight requests per worker")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--no-peers", action="store_true", help="skip the side by side with Dynamo's indexer"
    )
    p.add_argument(
        "--peer-workers", type=int, default=64, help="fleet size of the side by side (64)"
    )
    p.add_argument(
        "--peer-rounds", type=int, default=2, help="rounds of the side by side (best of)"
    )
    p.add_argument(
        "--peer-requests",
        type=int,
        default=1500,
        help="requests routed for the side by side (1500: ~1M blocks held at 64 workers)",
    )
    p.set_defaults(func=run)


class Fleet:
    """N simulated workers and the in-flight load the router sees."""

    def __init__(self, n: int, capacity: int, inflight: int) -> None:
        self.workers = [worker(i) for i in range(n)]
        self.engines = [
            GlobalCacheEngine(CacheEngine("cpu", capacity, "lru", 1.0, 0.0, record_events=True))
            for _ in range(n)
        ]
        self.load = dict.fromkeys(self.workers, 0)
        self._recent: deque[tuple[Worker, int]] = deque()
        self._inflight = inflight * n

    def serve(self, w: Worker, keys: BlockKeys) -> int:
        """Run the request on worker `w`: its hit blocks."""
        engine = self.engines[w.worker_id]
        gpu = np.arange(keys.size, dtype=np.int64)
        plan = engine.get(keys, gpu)
        _finish(engine, plan)
        _finish(engine, engine.put(keys, gpu))
        self._recent.append((w, keys.size))
        self.load[w] += keys.size
        if len(self._recent) > self._inflight:
            done, n = self._recent.popleft()
            self.load[done] -= n
        return plan.hit_blocks.total

    def events(self, w: Worker) -> list[KVEvent]:
        return self.engines[w.worker_id].cpu.index.drain_events()


def to_router_events(events: list[KVEvent]) -> list[RouterEvent]:
    out: list[RouterEvent] = []
    for e in events:
        if isinstance(e, BlockRemoved):
            out.append(Removed(split_keys(e.keys.tobytes())))
        elif isinstance(e, AllBlocksCleared):
            out.append(Cleared())
        else:
            out.append(Stored(split_keys(e.keys.tobytes()), e.parent))
    return out


def _count(present: dict[BlockKey, int], batch: list[RouterEvent]) -> None:
    for e in batch:
        if isinstance(e, Stored):
            for key in e.keys:
                present[key] = present.get(key, 0) + 1
        elif isinstance(e, Removed):
            for key in e.keys:
                if present[key] == 1:
                    del present[key]
                else:
                    present[key] -= 1


def replay_routed(
    trace: Trace, keys: BlockKeys, n: int, capacity: int, inflight: int, index: str | None
) -> dict[str, Any]:
    """One pass; `index` None routes round robin (no router at all)."""
    fleet = Fleet(n, capacity, inflight)
    router = Router(index) if index is not None else None
    if router is not None:
        for w in fleet.workers:
            router.add_worker(w)
    offsets = trace.offsets.tolist()
    hits = events = event_blocks = 0
    apply_s = 0.0
    match_ns: list[int] = []
    floor_ns: list[int] = []
    present: dict[BlockKey, int] = {}
    """Key -> how many workers hold it, from the same events."""
    for r in range(len(offsets) - 1):
        req = BlockKeys(keys[offsets[r] : offsets[r + 1]])
        if router is None:
            w = fleet.workers[r % n]
        else:
            req_keys = split_keys(req.tobytes())
            t0 = time.perf_counter_ns()
            scores = router.find_matches(req_keys)
            t1 = time.perf_counter_ns()
            for key in req_keys:  # the floor: the same walk on a plain dict
                if key not in present:
                    break
            t2 = time.perf_counter_ns()
            match_ns.append(t1 - t0)
            floor_ns.append(t2 - t1)
            w = router.selector.select(scores, len(req_keys), loads=fleet.load).worker
        hits += fleet.serve(w, req)
        if router is not None:
            batch = to_router_events(fleet.events(w))
            t0 = time.perf_counter_ns()
            router.apply(w, batch)
            apply_s += (time.perf_counter_ns() - t0) / 1e9
            events += len(batch)
            event_blocks += sum(len(e.keys) for e in batch if not isinstance(e, Cleared))
            _count(present, batch)
    busiest = max(fleet.load.values())  # of the last in-flight window only
    result: dict[str, Any] = {"hit_ratio": hits / max(trace.num_lookups, 1)}
    result["busiest_worker_inflight_share"] = busiest / max(sum(fleet.load.values()), 1)
    if router is not None:
        m, f = np.percentile(match_ns, [50, 99]), np.percentile(floor_ns, [50, 99])
        result |= {
            "events": events,
            "event_blocks": event_blocks,
            "events_per_s": events / apply_s if apply_s else 0.0,
            "event_blocks_per_s": event_blocks / apply_s if apply_s else 0.0,
            "find_matches_us_p50": m[0] / 1e3,
            "find_matches_us_p99": m[1] / 1e3,
            "dict_floor_us_p50": f[0] / 1e3,
            "dict_floor_us_p99": f[1] / 1e3,
            "find_matches_vs_floor_p50": m[0] / f[0] if f[0] else 0.0,
        } | time_remove(router)
    return result


def time_remove(router: Router) -> dict[str, Any]:
    """Remove the worker holding most blocks, as a subscriber does for a dead
    sidecar: the call itself, then the sweep of its entries in the slices
    `router serve` runs between requests (the longest slice is the longest
    the router cannot answer). The floor: the sweep's total, what removing
    the worker eagerly costs."""
    sizes = router.index.workers()
    held = sum(sizes.values())
    w = max(sizes, key=sizes.__getitem__)
    t0 = time.perf_counter_ns()
    router.remove_worker(w.worker_id)
    remove_ns = time.perf_counter_ns() - t0
    slices: list[int] = []
    more = True
    while more:
        t0 = time.perf_counter_ns()
        more = router.sweep()
        slices.append(time.perf_counter_ns() - t0)
    return {
        "held_blocks": held,
        "removed_blocks": sizes[w],
        "remove_worker_ms": remove_ns / 1e6,
        "sweep_slice_ms_max": max(slices) / 1e6,
        "sweep_total_ms": sum(slices) / 1e6,
        "remove_vs_sweep": remove_ns / sum(slices) if sum(slices) else 0.0,
    }


def run(args: argparse.Namespace) -> int:
    if not args.trace.is_file():
        print(f"error: trace not found: {args.trace}", file=sys.stderr)
        return 2
    trace = load_mooncake(args.trace, args.tokens_per_block, args.limit)
    keys = keys_from_ints(trace.block_ids)
    capacity = max(1, round(args.capacity * trace.num_unique_blocks()))
    runs: dict[str, dict[str, Any]] = {}
    for n in args.workers:
        runs[f"{n}/round_robin"] = replay_routed(trace, keys, n, capacity, args.inflight, None)
        for index in INDEXES:
            runs[f"{n}/{index}"] = replay_routed(trace, keys, n, capacity, args.inflight, index)
        ratios = {runs[f"{n}/{i}"]["hit_ratio"] for i in INDEXES}
        if len(ratios) != 1:
            print(f"error: the indexes disagree at {n} workers: {ratios}", file=sys.stderr)
            return 1
    result = {
        "trace": args.trace.name,
        "requests": trace.num_requests,
        "block_lookups": trace.num_lookups,
        "tokens_per_block": trace.tokens_per_block,
        "capacity_blocks_per_worker": capacity,
        "inflight_per_worker": args.inflight,
        "infinite_hit_ratio": infinite_hit_ratio(trace),
        "runs": runs,
    }
    _print(result, args.workers)
    if not args.no_peers:
        status = _side_by_side(args, trace, keys, capacity, result)
        if status:
            return status
    if args.json:
        write_json(args.json, result)
    return 0


def _print(result: dict[str, Any], fleet_sizes: list[int]) -> None:
    print(
        f"{result['requests']:,} requests, {result['block_lookups']:,} block lookups of "
        f"{result['tokens_per_block']} tokens; {result['capacity_blocks_per_worker']:,} "
        f"blocks per worker; unlimited-cache hit ratio {result['infinite_hit_ratio']:.3f}"
    )
    rows = []
    for n in fleet_sizes:
        rr = result["runs"][f"{n}/round_robin"]["hit_ratio"]
        for index in INDEXES:
            r = result["runs"][f"{n}/{index}"]
            rows.append(
                [
                    n,
                    index,
                    rr,
                    r["hit_ratio"],
                    r["events_per_s"],
                    r["event_blocks_per_s"],
                    r["find_matches_us_p50"],
                    r["find_matches_us_p99"],
                    r["dict_floor_us_p50"],
                    r["find_matches_vs_floor_p50"],
                    r["held_blocks"],
                    r["remove_worker_ms"],
                    r["sweep_slice_ms_max"],
                    r["sweep_total_ms"],
                ]
            )
    headers = ["workers", "index", "hit rr", "hit overlap", "events/s", "blocks/s"]
    headers += ["match p50 us", "match p99 us", "dict p50 us", "match/dict p50"]
    headers += ["held blocks", "remove ms", "sweep slice max ms", "sweep total ms"]
    print_table(headers, rows)


def _side_by_side(
    args: argparse.Namespace, trace: Trace, keys: BlockKeys, capacity: int, result: dict
) -> int:
    """Add Dynamo's indexer beside ours to `result` (bench/router_dynamo.py)."""
    from bench.router_dynamo import compare, record, rows
    from sideenv import SideEnvError, ensure
    from sideenv.specs import DYNAMO

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        python = ensure(DYNAMO, log=log)
    except SideEnvError as exc:
        print(f"error: {exc}\nPass --no-peers to run without Dynamo.", file=sys.stderr)
        return 2
    log(f"bench router: recording {args.peer_requests} requests at {args.peer_workers} workers")
    stream = record(trace, keys, args.peer_workers, capacity, args.inflight, args.peer_requests)
    try:
        side = compare(stream, str(python), log, args.peer_rounds)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result["dynamo"] = {k: v for k, v in side.items() if k != "targets"}
    result["targets"] = side["targets"]
    print(
        f"\nside by side with Dynamo's RadixTree (best of {side['rounds']} rounds): "
        f"{side['workers']} workers, "
        f"{side['requests']:,} requests, {side['held_blocks']:,} blocks held, "
        f"deep queries {side['queries']['deep']} (median {side['deep_median_blocks']:.0f} blocks); "
        "scores identical"
    )
    headers, table = rows(side)
    print_table(headers, table)
    print_table(
        ["target", "value", "limit", "within"],
        [[k, t["value"], t["limit"], t["within"]] for k, t in side["targets"].items()],
    )
    return 0
