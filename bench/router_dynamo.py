"""`bench router`'s side by side with NVIDIA Dynamo's KV indexer.

The first `--peer-requests` requests of the trace are routed over a fleet of
`--peer-workers` simulated workers (as the main runs do, by overlap with
the flat index); every KV event the workers publish is recorded, with
blocks named by the trace's integer block ids. The recorded stream is then
replayed into each index in a process of its own (bench/router_peer.py):
Dynamo's `dynamo._core.RadixTree` (ai-dynamo-runtime, in its side
environment, installed on first use; `--no-peers` skips it) and this
router's native (C), radix and flat indexes. Each process applies every event, then
answers the same queries:

- `full`: every recorded request, whole; those whose best overlap is at
  least `DEEP_BLOCKS` form the `deep` class;
- `short`: the first `SHORT_BLOCKS` blocks of every request (hits, mostly);
- `miss`: requests of blocks no worker ever held.

Their scores must be identical across the three (the run fails otherwise).
The replays run `--peer-rounds` rounds in turn (dynamo, native, radix, flat,
dynamo, ...), each figure the best of its index's rounds, so that a noisy neighbour
on a shared machine slows one round of every index rather than one index.
Python's garbage collector stays on, as in `router serve`.
Targets (issue 31), each ratio ours / Dynamo's, for each of our
indexes: ingest blocks/s >= 1.0x, bytes per held block <= 1.0x,
find_matches p50 <= 1.0x on deep queries and <= 0.5x on short ones and
misses; remove_worker <= 1 ms; the longest the router is busy in one piece
(one event, a removal's call or one sweep slice) <= 5 ms. (Dynamo's "busy"
column is only its calls' queueing: its own thread's time is not visible.)
The longest event is also given by the calling thread's CPU time, which
leaves out preemption by other processes (the target uses the wall clock).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from bench.router import INDEXES, Fleet
from bench.targets import Target, at_least, at_most
from cachesim.trace import Trace
from contract.ids import BlockKeys
from router.keys import split_keys
from router.router import Router
from sidecar.control.events import AllBlocksCleared, BlockRemoved, KVEvent

DEEP_BLOCKS = 512
SHORT_BLOCKS = 8
MISS_QUERIES = 500
ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("dynamo", *INDEXES)


def _ids(keys: BlockKeys) -> list[int]:
    return np.asarray(keys).view(np.uint64).reshape(-1, 2)[:, 0].tolist()


def _wire(events: list[KVEvent]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for e in events:
        if isinstance(e, AllBlocksCleared):
            out.append(["cleared", [], None])
        elif isinstance(e, BlockRemoved):
            out.append(["removed", _ids(e.keys), None])
        else:
            parent = None if e.parent is None else int.from_bytes(bytes(e.parent)[:8], "little")
            out.append(["stored", _ids(e.keys), parent])
    return out


def record(
    trace: Trace, keys: BlockKeys, n: int, capacity: int, inflight: int, limit: int
) -> dict[str, Any]:
    """Route the first `limit` requests, recording every worker's events."""
    from bench.router import to_router_events

    fleet = Fleet(n, capacity, inflight)
    router = Router()
    for w in fleet.workers:
        router.add_worker(w)
    offsets = trace.offsets.tolist()
    batches: list[list[Any]] = []
    requests: list[list[int]] = []
    for r in range(min(limit, len(offsets) - 1)):
        req = BlockKeys(keys[offsets[r] : offsets[r + 1]])
        scores = router.find_matches(split_keys(req.tobytes()))
        w = router.selector.select(scores, req.size, loads=fleet.load).worker
        fleet.serve(w, req)
        events = fleet.events(w)
        router.apply(w, to_router_events(events))
        batches.append([w.worker_id, _wire(events)])
        requests.append(_ids(req))
    sizes = router.index.workers()
    held = sum(sizes.values())
    remove = max(sizes, key=sizes.__getitem__).worker_id
    top = int(trace.block_ids.max()) + 1
    rng = random.Random(0)
    misses = [[top + rng.randrange(1 << 40) for _ in range(64)] for _ in range(MISS_QUERIES)]
    queries = requests + [q[:SHORT_BLOCKS] for q in requests] + misses
    return {
        "batches": batches,
        "queries": queries,
        "remove": remove,
        "held_blocks": held,
        "classes": {
            "full": len(requests),
            "short": len(requests),
            "miss": len(misses),
        },
    }


def _run_one(impl: str, python: str, stream_file: Path, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [python, "-m", "bench.router_peer", "--impl", impl]
    cmd += ["--stream", str(stream_file), "--out", str(out)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{impl} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def compare(
    stream: dict[str, Any], dynamo_python: str, log: Callable[[str], None], repeats: int = 2
) -> dict[str, Any]:
    """Replay `stream` into every index, `repeats` rounds in turn (a noisy
    neighbour then slows one round of each, not one index); per index the
    best of its rounds for each figure. The figures, ratios and targets."""
    raws: dict[str, list[dict[str, Any]]] = {impl: [] for impl in IMPLS}
    with tempfile.TemporaryDirectory(prefix="kvs-bench-router-") as tmp:
        stream_file = Path(tmp) / "stream.msgpack"
        stream_file.write_bytes(msgpack.packb(stream))
        for round_ in range(repeats):
            for impl in IMPLS:
                log(
                    f"bench router: round {round_ + 1}/{repeats}, replaying "
                    f"{len(stream['batches']):,} event batches into {impl}"
                )
                python = dynamo_python if impl == "dynamo" else sys.executable
                out = Path(tmp) / f"{impl}.json"
                raws[impl].append(_run_one(impl, python, stream_file, out))
    reference = raws["dynamo"][0]["scores"]
    for impl, runs in raws.items():
        for run in runs:
            if run["scores"] != reference:
                pairs = enumerate(zip(run["scores"], reference, strict=True))
                bad = next(i for i, (a, b) in pairs if a != b)
                raise RuntimeError(
                    f"{impl} and Dynamo disagree on query {bad}: "
                    f"{run['scores'][bad]} vs {reference[bad]}"
                )
    classes = _classes(stream, reference)
    held = stream["held_blocks"]
    figures = {
        impl: _best([_figures(run, classes, held) for run in runs]) for impl, runs in raws.items()
    }
    deep = [max(dict(reference[i]).values()) for i in classes["deep"]]
    return {
        "workers": 1 + max(b[0] for b in stream["batches"]),
        "requests": stream["classes"]["full"],
        "held_blocks": held,
        "rounds": repeats,
        "deep_median_blocks": float(np.median(deep)) if deep else 0.0,
        "queries": {name: len(ix) for name, ix in classes.items()},
        "figures": figures,
        "targets": _targets(figures),
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's best over the rounds (the highest rate, the lowest time or size)."""
    return {k: (max if k == "ingest_blocks_per_s" else min)(r[k] for r in runs) for k in runs[0]}


def _classes(stream: dict[str, Any], scores: list[list[list[int]]]) -> dict[str, list[int]]:
    n = stream["classes"]["full"]
    best = [max((s for _, s in row), default=0) for row in scores]
    return {
        "deep": [i for i in range(n) if best[i] >= DEEP_BLOCKS],
        "short": list(range(n, 2 * n)),
        "miss": list(range(2 * n, len(scores))),
    }


def _figures(raw: dict[str, Any], classes: dict[str, list[int]], held: int) -> dict[str, Any]:
    match = np.asarray(raw["match_ns"], dtype=np.float64) / 1e3
    out = {
        "ingest_blocks_per_s": raw["ingest_blocks_per_s"],
        "ingest_event_max_ms": raw["ingest_event_max_ms"],
        "ingest_event_max_cpu_ms": raw["ingest_event_max_cpu_ms"],
        "bytes_per_held_block": raw["rss_growth_bytes"] / max(held, 1),
        "remove_call_ms": raw["remove_call_ms"],
        "remove_slice_max_ms": raw["remove_slice_max_ms"],
        "remove_total_ms": raw["remove_total_ms"],
    }
    for name, ix in classes.items():
        if ix:
            p50, p99 = np.percentile(match[ix], [50, 99])
            out[f"match_{name}_us_p50"], out[f"match_{name}_us_p99"] = p50, p99
    return out


def _targets(figures: dict[str, dict[str, Any]]) -> dict[str, Target]:
    dyn = figures["dynamo"]
    targets: dict[str, Target] = {}

    def ratio(name: str, impl: str, figure: str, limit: float, higher: bool = False) -> None:
        # A figure with no queries of its class is not measured, never met.
        known = figure in dyn and figure in figures[impl]
        value = figures[impl][figure] / dyn[figure] if known else None
        rule = f"{figure}, ours / Dynamo's, {'>=' if higher else '<='} {limit:g}"
        target = at_least if higher else at_most
        targets[f"{name}/{impl}"] = target(value, limit, rule)

    for impl in IMPLS[1:]:
        ratio("ingest_blocks_per_s_vs_dynamo", impl, "ingest_blocks_per_s", 1.0, higher=True)
        ratio("bytes_per_held_block_vs_dynamo", impl, "bytes_per_held_block", 1.0)
        ratio("find_matches_deep_p50_vs_dynamo", impl, "match_deep_us_p50", 1.0)
        ratio("find_matches_short_p50_vs_dynamo", impl, "match_short_us_p50", 0.5)
        ratio("find_matches_miss_p50_vs_dynamo", impl, "match_miss_us_p50", 0.5)
        f = figures[impl]
        rule = "remove_worker's call, ms, <= 1"
        targets[f"remove_worker_ms/{impl}"] = at_most(f["remove_call_ms"], 1.0, rule)
        busy = max(f["ingest_event_max_ms"], f["remove_slice_max_ms"])
        rule = "the longest busy piece (an event, a removal slice), ms, <= 5"
        targets[f"longest_busy_ms/{impl}"] = at_most(busy, 5.0, rule)
    return targets


def rows(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The table of the side by side: one row per index."""
    headers = ["index", "ingest blocks/s", "bytes/block", "deep p50 us", "short p50 us"]
    headers += ["miss p50 us", "remove ms", "busy max ms", "event max CPU ms"]
    out = []
    for impl, f in result["figures"].items():
        out.append(
            [
                impl,
                f["ingest_blocks_per_s"],
                f["bytes_per_held_block"],
                f.get("match_deep_us_p50", float("nan")),
                f["match_short_us_p50"],
                f["match_miss_us_p50"],
                f["remove_call_ms"],
                max(f["ingest_event_max_ms"], f["remove_slice_max_ms"]),
                f["ingest_event_max_cpu_ms"],
            ]
        )
    return headers, out
