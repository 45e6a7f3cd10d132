"""`kvsidecar bench control`'s per-call rows: what an engine feels per call,
side by side with the memcpy floor and two peers.

Rows (bench/peers/calls.py runs them the same way for every system, each
system in a process of its own, one after another, so the 4 GiB a side of
2,048 x 2 MiB blocks is free before the next system starts; in ROUNDS
rounds, every other one in reverse order, a row's p50 the mean of its
rounds'; LMCache in the first round only):
- save / load of 1, 32 and 2,048 blocks of 2 MiB (16 tokens of Llama-3-8B's
  128 KiB a token) and of 128 KiB (one token), until done;
- lookup of a cached prompt (hit) and of one whose first block misses, at
  256, 2,048 and 16,384 tokens (2 MiB blocks).
Systems: `memcpy` (the same bytes by the same C copy between two
page-aligned buffers: the floor of save and load), `kvsidecar` (a real
sidecar and KVClient), `aibrix` (AIBrix 0.8.0's in-process L1 cache,
bench/peers/aibrix_worker.py) and `lmcache` (LMCache 0.5.6's multiprocess
server, bench/peers/lmcache_worker.py). `--no-peers` skips the last two.

Lookup rates: 4 and 16 client processes in closed loop, each a registered
KVClient looking up a cached 64-block prompt, side by side (RATE_ROUNDS
slices in rotating order) with a raw pyzmq ping-pong of lookup sizes from
as many clients (bench.control's floor).

Targets (in `targets`, names starting "calls."): per-call save and load of
one 2 MiB block <= 1.0x AIBrix's; every lookup row <= 1.0x AIBrix's; every
row <= 0.5x LMCache's; 2,048-block saves and loads >= 0.9x memcpy's speed
(memcpy's time over ours); the 4-client lookup rate >= 2 x 0.53 = 1.06x the
raw ping-pong's (0.53x: the rate before issue 30).

Speed against memcpy (`vs[row]["memcpy"]`, the table's "x memcpy speed"):
kvsidecar's worker pairs each save and load of the largest transfer (2,048
blocks: the rows the target judges) with the floor's call of the same row,
back to back in its process (bench/peers/calls.py, "paired floor"), the
floor copying the same bytes between the same memory as kvsidecar's call,
the engine's tensors and the cache's slots, in whole-block runs
(bench/peers/kvsidecar_worker.py, SameMemoryFloor); the figure is the
median of the pairs' ratios, the mean over the rounds. The memcpy worker's
own rows (the table's memcpy column) are timed in a phase of their own,
between buffers of its own: on these VMs memory ran at ~20 or ~38 GB/s
from one phase to the next, and buffers of one kind up to 1.2x apart, so
the ratio of p50s from separate phases (`vs[row]["memcpy_separate"]`, kept
for comparison) could read 0.57x or 1.01x for the same code
(docs/measurements.md, "Saves in bands" and "The floor's memory"). Rows
the worker could not pair fall back to it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.control_calls_report import print_calls
from bench.control_client import ControlClient
from bench.fleet import Fleet, Timing
from bench.peers import PEERS, WorkerResult, run_worker
from bench.peers.calls import GEOMETRIES, LOOKUP_GEOMETRY, Spec, block_bytes
from bench.targets import at_least, at_most
from cachesim.report import write_json
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar

ROUNDS = 2
ONCE = ("lmcache",)
"""Systems measured in the first round only: LMCache's rows are 4-200x
kvsidecar's, far beyond the machine's drift, and one round of them takes
~9 minutes."""
RATE_CLIENTS = (4, 16)
RATE_BLOCKS = 64
RATE_ROUNDS = 10
BEFORE_ISSUE_30 = 0.53
"""The 4-client lookup rate over the raw ping-pong's before issue 30."""
RATE_TARGET = 2 * BEFORE_ISSUE_30
AIBRIX_LIMIT, LMCACHE_LIMIT, MEMCPY_LIMIT = 1.0, 0.5, 0.9


def spec_for(quick: bool, seconds: float | None, workdir: Path) -> Spec:
    if quick:
        return Spec(
            transfer_blocks=[1, 4],
            lookup_tokens=[256],
            seconds=seconds or 0.02,
            min_samples=3,
            warmup=1,
            workdir=str(workdir),
        )
    return Spec(seconds=seconds or 0.5, workdir=str(workdir))


def measure_calls(quick: bool, seconds: float | None, peers: bool, workdir: Path) -> dict[str, Any]:
    """Every system's rows, the lookup rates, and the targets."""
    spec = spec_for(quick, seconds, workdir)
    systems = ["memcpy", "kvsidecar", *(PEERS if peers else ())]
    specs = {
        "memcpy": Spec(**{**spec.__dict__, "lookup_tokens": []}),
        "kvsidecar": Spec(**{**spec.__dict__, "paired_floor": True}),
    }
    runs: dict[str, list[WorkerResult]] = {name: [] for name in systems}
    for r in range(1 if quick else ROUNDS):
        # Every other round in reverse, so no system always runs first or last.
        order = [s for s in systems if r == 0 or s not in ONCE]
        for name in order if r % 2 == 0 else order[::-1]:
            print(f"per-call rows, round {r + 1}: {name} ...", file=sys.stderr, flush=True)
            result = run_worker(name, specs.get(name, spec))
            if result.error and name in ("memcpy", "kvsidecar"):
                raise RuntimeError(result.error)
            if result.error:
                print(f"{name}: no rows: {result.error}", file=sys.stderr, flush=True)
            runs[name].append(result)
    results = {name: merge(parts) for name, parts in runs.items()}
    print("lookup rates ...", file=sys.stderr, flush=True)
    rate_seconds = 0.05 if quick else spec.seconds * 4
    rates = measure_rates(workdir, rate_seconds, 2 if quick else RATE_ROUNDS)
    out: dict[str, Any] = {
        "spec": spec.__dict__,
        "geometries": {g: {**v, "block_bytes": block_bytes(v)} for g, v in GEOMETRIES.items()},
        "lookup_geometry": LOOKUP_GEOMETRY,
        "systems": {
            name: {"version": r.version, "notes": r.notes, "error": r.error}
            for name, r in results.items()
        },
        "rows_us": {name: r.rows for name, r in results.items()},
        "rounds_us": {name: [r.rows for r in parts] for name, parts in runs.items()},
        "lookup_rates_rps": rates,
    }
    out["vs"] = ratios(out["rows_us"])
    out["targets"] = targets(out, peers)
    return out


def merge(parts: list[WorkerResult]) -> WorkerResult:
    """One system's rounds as one: per row, the mean of the rounds' p50s and
    means (and of the paired floor's figures, where every round has them),
    the worst p99, all the samples; the first error, if any round failed."""
    failed = [p for p in parts if p.error]
    if failed:
        return failed[0]
    rows: dict[str, dict[str, float]] = {}
    for row in parts[0].rows:
        of = [p.rows[row] for p in parts]
        rows[row] = {
            "p50": sum(s["p50"] for s in of) / len(of),
            "p99": max(s["p99"] for s in of),
            "mean": sum(s["mean"] for s in of) / len(of),
            "samples": sum(s["samples"] for s in of),
        }
        for key in ("floor_p50", "vs_floor"):
            if all(key in s for s in of):
                rows[row][key] = sum(s[key] for s in of) / len(of)
    notes = "; ".join(dict.fromkeys(p.notes for p in parts if p.notes))
    return WorkerResult(parts[0].version, rows, notes)


def measure_rates(workdir: Path, seconds: float, rounds: int) -> dict[str, dict[str, float]]:
    """{clients: {"raw", "lookup", "lookup_vs_raw"}}: closed-loop calls/s,
    the KVClient lookups and the raw ping-pong side by side."""
    # bench.control imports this module for its flags and its last table
    from bench.control import EchoServer, message_sizes, run_in_rounds

    sizes = message_sizes()
    sidecar = LocalSidecar(
        workdir / "rates", cpu_capacity=str(64 << 20), settings=BENCH_SIDECAR_SETTINGS, tag="rates"
    )
    (workdir / "rates").mkdir(parents=True, exist_ok=True)
    fleet: Fleet | None = None
    echo: EchoServer | None = None
    most = max(RATE_CLIENTS)
    try:
        fleet = Fleet(ControlClient, most)
        echo = EchoServer(workdir / "rates-echo.sock", sizes)
        sidecar.start()
        kwargs = [
            {"endpoint": sidecar.endpoint, "index": i, "gpu_blocks": RATE_BLOCKS}
            for i in range(most)
        ]
        fleet.call("connect", most, kwargs)
        fleet.call("presave", 1, [{"blocks": RATE_BLOCKS}])
        timing = Timing(seconds / rounds, 5, 5)
        ping = {"endpoint": echo.endpoint, "header_bytes": sizes["lookup_request"]}
        tasks = [
            ("ping", {"blocks": RATE_BLOCKS, "timing": timing, "with_ids": False, **ping}),
            ("lookup", {"blocks": RATE_BLOCKS, "timing": timing}),
        ]
        out: dict[str, dict[str, float]] = {}
        for clients in RATE_CLIENTS:
            raw, lookup = run_in_rounds(fleet, tasks, clients, rounds, seconds + 60)
            out[str(clients)] = {
                "raw": raw["rate_rps"],
                "lookup": lookup["rate_rps"],
                "lookup_vs_raw": lookup["rate_rps"] / raw["rate_rps"],
            }
        fleet.close()
    finally:
        if fleet is not None:
            fleet.close()
        if echo is not None:
            echo.stop()
        shutdown = sidecar.close()
    if shutdown.exit_code != 0 or shutdown.leftovers:
        raise RuntimeError(f"the rates' sidecar exited {shutdown.exit_code}: {sidecar.log_tail()}")
    return out


def ratios(rows: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """{row: {"<system>": kvsidecar p50 / that system's p50}} for every row
    both measured. "memcpy": our speed as a share of the floor's, from the
    paired calls where the row has them, else the floor's p50 over ours;
    "memcpy_separate": the latter, whenever the memcpy worker measured the row."""
    ours = rows["kvsidecar"]
    out: dict[str, dict[str, float]] = {}
    for row, s in ours.items():
        out[row] = {}
        for name, theirs in rows.items():
            if name == "kvsidecar" or row not in theirs:
                continue
            if name == "memcpy":
                out[row]["memcpy_separate"] = theirs[row]["p50"] / s["p50"]
                out[row][name] = s.get("vs_floor", out[row]["memcpy_separate"])
            else:
                out[row][name] = s["p50"] / theirs[row]["p50"]
    return out


def targets(r: dict[str, Any], peers: bool) -> dict[str, dict[str, Any]]:
    vs, out = r["vs"], {}
    systems = r["systems"]
    for row, by in vs.items():
        kind, rest = row.split(".", 1)
        aibrix_row = row in ("save.2MiB.1", "load.2MiB.1") or kind.startswith("lookup")
        if peers and aibrix_row:
            rule = f"kvsidecar p50 / AIBrix p50 <= {AIBRIX_LIMIT:g}"
            out[f"calls.{row}.vs_aibrix"] = at_most(by.get("aibrix"), AIBRIX_LIMIT, rule)
            if "aibrix" not in by:
                out[f"calls.{row}.vs_aibrix"]["not_measured"] = systems["aibrix"]["error"]
        if peers:
            rule = f"kvsidecar p50 / LMCache MP server p50 <= {LMCACHE_LIMIT:g}"
            out[f"calls.{row}.vs_lmcache"] = at_most(by.get("lmcache"), LMCACHE_LIMIT, rule)
            if "lmcache" not in by:
                out[f"calls.{row}.vs_lmcache"]["not_measured"] = systems["lmcache"]["error"]
        if rest.endswith(".2048") and "memcpy" in by:
            paired = "vs_floor" in r["rows_us"]["kvsidecar"][row]
            rule = (
                f"median of memcpy time / kvsidecar time over calls paired back to back "
                f">= {MEMCPY_LIMIT:g} (speed vs the floor)"
                if paired
                else f"memcpy p50 / kvsidecar p50 >= {MEMCPY_LIMIT:g} (speed vs the floor; "
                "separate phases: the calls could not be paired)"
            )
            out[f"calls.{row}.vs_memcpy"] = at_least(by["memcpy"], MEMCPY_LIMIT, rule)
    four = r["lookup_rates_rps"]["4"]["lookup_vs_raw"]
    rule = (
        f">= 2 x {BEFORE_ISSUE_30:g} x the raw ping-pong's rate, 4 clients, {RATE_BLOCKS} "
        "blocks, side by side"
    )
    out["calls.lookup_rate_4_clients_vs_raw"] = at_least(four, RATE_TARGET, rule)
    return out


def run_calls(quick: bool, seconds: float | None, peers: bool) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvsbench-calls-"))
    try:
        return measure_calls(quick, seconds, peers, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--calls-only",
        action="store_true",
        help="only the per-call rows (save/load/lookup beside memcpy and the peers)",
    )
    which.add_argument("--no-calls", action="store_true", help="skip the per-call rows")
    parser.add_argument(
        "--no-peers",
        action="store_true",
        help="per-call rows without the peers (AIBrix, LMCache), which otherwise are "
        "installed into side environments on first use and run",
    )


def run_calls_only(args: argparse.Namespace) -> int:
    calls = run_calls(args.quick, args.seconds, not args.no_peers)
    result = {"calls": calls, "targets": calls.pop("targets"), "quick": bool(args.quick)}
    print_calls({**calls, "targets": result["targets"]})
    if args.json:
        write_json(args.json, result)
    return 0
