"""`kvsidecar bench control`: the sidecar's control path against raw ZeroMQ.

Every figure and its floor come from the same run: for each (blocks,
clients) pair the floors run first, then the sidecar cases, back to back.

- Floor: a raw pyzmq DEALER -> ROUTER ping-pong over ipc (the sidecar's
  transport) against an echo ROUTER in its own process, with requests and
  replies of the sizes of a lookup (header + 16-byte keys -> small header)
  and of a load/save plan (header + keys + int64 ids -> header + source and
  destination ids), for 1, 64 and 2,048 blocks (and the longer requests
  `--blocks` names), from 1 and from 4 client processes; and for the full
  loads and saves, which take two round trips, a plan-sized ping-pong
  followed by one of the sizes of a Complete and its ack
  (`load_save_full`). Both ends send with `protocol.send_frames`, as the
  sidecar and the shim do (frames of 64 KiB or more without a copy).
  `raw_rate_rps` is the closed-loop rate of the 64-block lookup-sized
  ping-pong.
- The sidecar: a real `kvsidecar serve` subprocess; every client process
  registers a KVClient with `hot_path=False`, so that every call asks the
  sidecar (as lookups past the CPU tier and CUDA loads do; through the hot
  index, CPU-tier lookups and loads make no round trip, so ZeroMQ is no
  floor for them: the per-call rows below time that path), and with a
  tiny KV layout (1 layer, 128 B per block), so the KV bytes a 2,048-block
  load or save copies through shm (256 KiB, ~20 µs at memcpy speed) are
  negligible; the copy calls' per-block bookkeeping is not, and is part of
  the full figures. Figures:
  `lookup_rtt_us` (KVClient.lookup: hashing + one round trip),
  `lookup_keys_rtt_us` (a Lookup of pre-hashed keys on the raw protocol),
  `load_plan_rtt_us` / `save_plan_rtt_us` (a raw Load / Save request until
  its plan reply; the plan is cancelled untimed), `load_full_us` /
  `save_full_us` (KVClient.load / save(...).wait(): hashing, plan, the shm
  copies, Complete and its ack, i.e. two round trips; a saved prefix is
  deleted untimed so the next save stores it again). Lookups and loads hit a
  pre-saved prefix of the longest request; each client saves its own
  sequence. The CPU tier is sized to hold both.
- Hashing: `hash_us`, KeyHasher.hash_tokens of the same token counts.
- The lookup target's terms side by side: `lookup_paired_us`, one client
  timing a raw 2,048-block ping-pong, hashing 2,048 blocks and
  KVClient.lookup of them, one call of each per round in rotating order.
  These VMs drift by +-20% in speed over seconds, so three figures measured
  in separate cases can differ by more than the target's 100 µs slack;
  side by side they cannot drift apart. The target is judged on these;
  `targets.lookup_2048_p50_us.from_separate_cases` shows the same rule on
  the separate cases of the tables. A fourth term, `floor_after_hash`, is
  the same raw ping-pong timed right after an untimed hashing of the
  tokens, as KVClient.lookup sends: on these VMs a round trip after ~0.5 ms
  of one-sided work costs more than one back to back (the other threads
  went to sleep). `targets.lookup_2048_p50_us.with_floor_after_hash` shows
  the rule with that floor, i.e. the sidecar's own share of the excess.
- The rate target's terms side by side: `rates_paired_rps`, 4 clients
  running the raw 64-block ping-pong, KVClient.lookup and pre-hashed
  Lookups, each for 3 x --seconds in all, in 20 slices in rotating order.
  Measured in the 3 slices of the table's cases, a burst of slowness that
  hits the floor's slice and not the sidecar's moves the ratio by 0.1 or
  more on these VMs; 20 slices spread it. The target is judged on these;
  `targets.lookup_rate_4_clients_vs_raw.from_separate_cases` shows it on
  the table's rates.
- Header encoding: see `bench.codecs`.
- Per-call rows (`bench.control_calls`, after the round trips): save / load
  of 1, 32 and 2,048 blocks of 2 MiB and 128 KiB and lookups of 256 to
  16,384 tokens, beside a memcpy of the same bytes, AIBrix's in-process L1
  cache and LMCache's multiprocess server (each installed on first use into
  a side environment; `--no-peers` skips them); 4- and 16-client lookup
  rates. `--calls-only` runs only these, `--no-calls` skips them. Speed
  against memcpy of the 2,048-block saves and loads is the median over
  calls each paired back to back with the memcpy of the same row in
  kvsidecar's worker, in kvsidecar's own memory: from the engine's tensors
  into the cache's slots and back (memory speed here moves by up to 2x
  between phases, and differs between buffers).

Latencies are µs, p50 and p99 over every call of every client of a case;
with 4 clients they all run for the same seconds at once. `vs_floor` holds
each figure over the floor of the same message sizes and client count.
Targets: 2,048-block lookup p50 <= floor p50 + hashing p50 + 100 µs (1
client, from `lookup_paired_us`); 64-block lookups/s from 4 clients >= 0.5x
the raw rate from 4 (from `rates_paired_rps`).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.codecs import measure_codecs
from bench.control_calls import add_call_arguments, run_calls, run_calls_only
from bench.control_calls_report import print_calls
from bench.control_client import BLOCK_BYTES, ControlClient, echo_main
from bench.control_report import print_report
from bench.fleet import Fleet, Samples, Timing, summarize
from cachesim.report import write_json
from contract import protocol as p
from contract import replies
from contract.ops import OpKind
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar
from shm.layout import BlockLayout

BLOCK_COUNTS = (1, 64, 2048)
"""Request sizes of every run; `--blocks` adds longer ones."""
TARGET_BLOCKS = 2048
"""The request size of the lookup target."""
CLIENT_COUNTS = (1, 4)
RATE_BLOCKS = 64
LOOKUP_SLACK_US = 100.0
RATE_TARGET = 0.5
ROUNDS = 3  # each case runs in this many slices, interleaved with the other cases
RATE_ROUNDS = 20  # slices of each term of the rate target, side by side
SLOT_BYTES = BlockLayout(num_layers=1, layer_block_bytes=BLOCK_BYTES).slot_stride
MIN_CAPACITY = 64 << 20  # 16,384 slots: the lookup set plus 4 clients' saves of 2,048

SIDECAR_FIGURES = {
    # figure: (client task, the floor_rtt_us shape with the same message sizes)
    "lookup_rtt_us": ("lookup", "lookup"),
    "lookup_keys_rtt_us": ("lookup_keys", "lookup"),
    "load_plan_rtt_us": ("load_plan", "load_save"),
    "save_plan_rtt_us": ("save_plan", "load_save"),
    "load_full_us": ("load_full", "load_save_full"),
    "save_full_us": ("save_full", "load_save_full"),
}
RATE_FIGURES = {"lookup_rtt_us": "lookup", "lookup_keys_rtt_us": "lookup_keys"}
"""Figures whose closed-loop rate at RATE_BLOCKS is reported (as <name>_rate_rps)."""
ABOUT = {
    "floor_rtt_us": "[lookup|load_save|load_save_full][blocks][clients]: raw pyzmq "
    "DEALER/ROUTER ping-pong over ipc against an echo ROUTER, with the request and reply sizes "
    "of a lookup or of a load/save plan (see message_header_bytes); load_save_full: a plan-sized "
    "ping-pong then a Complete-sized one, the two round trips of a full load or save; µs",
    "lookup_rtt_us": "[blocks][clients]: KVClient.lookup(tokens): hashing + one round trip",
    "lookup_keys_rtt_us": "[blocks][clients]: a Lookup of pre-hashed keys on the raw protocol",
    "load_plan_rtt_us": "[blocks][clients]: raw Load request -> plan reply (all blocks hit); "
    "the plan is cancelled untimed",
    "save_plan_rtt_us": "[blocks][clients]: raw Save request -> plan reply (new blocks); "
    "the plan is cancelled untimed",
    "load_full_us": "[blocks][clients]: KVClient.load(...).wait(): hashing, plan, shm -> KV "
    "copies, Complete and its ack (two round trips)",
    "save_full_us": "[blocks][clients]: KVClient.save(...).wait(): hashing, plan, KV -> shm "
    "copies, Complete and its ack; the blocks are deleted untimed after each save",
    "hash_us": "[blocks]: KeyHasher.hash_tokens of blocks x 16 tokens, one process",
    "sidecar_requests": "requests the sidecar answered by kind (its stats), warm-ups included: "
    "every timed lookup asked it (KVClient with hot_path=False)",
    "lookup_paired_us": "[floor|hash|lookup|floor_after_hash]: the terms of the 2,048-block "
    "lookup target (raw ping-pong of lookup sizes, hashing, KVClient.lookup), one client "
    "timing one call of each per round in rotating order, so the machine's speed drifts hit "
    "all of them; floor_after_hash: the raw ping-pong timed right after an untimed hashing",
    "rates_paired_rps": "[raw|lookup|lookup_keys]: the terms of the 4-client rate target "
    "(raw ping-pong, KVClient.lookup, pre-hashed Lookups; 64 blocks, closed loop, req/s), "
    "measured in RATE_ROUNDS slices each in rotating order; *_vs_raw are their ratios",
    "raw_rate_rps": "[clients]: closed-loop requests/s of the 64-block lookup-sized ping-pong",
    "lookup_rate_rps": "[clients]: closed-loop KVClient.lookup calls/s, 64 blocks",
    "lookup_keys_rate_rps": "[clients]: closed-loop pre-hashed Lookups/s, 64 blocks",
    "vs_floor": "[figure][blocks][clients][p50|p99]: the figure over floor_rtt_us of the "
    "same sizes and client count (vs_floor_uses names the shape)",
    "encode_us": "[codec][message]: µs to encode + decode one request header",
    "keys_encode_us": "[format]: µs to encode + decode 2,048 keys, from and to numpy",
    "kv_block_bytes": "bytes of one KV block (1 layer): the bytes copied are negligible",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "control",
        help="lookup / load / save round trips through a sidecar, against raw pyzmq",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="timed seconds per case, in 3 interleaved rounds (default 1.5)",
    )
    parser.add_argument(
        "--blocks",
        type=_block_counts,
        default=(),
        metavar="N[,N...]",
        help="longer requests to measure in every case besides 1, 64 and 2,048 blocks, "
        "e.g. 16384,65536 (256k and 1M tokens at 16 a block)",
    )
    parser.add_argument("--quick", action="store_true", help="short cases, for the test suite")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    add_call_arguments(parser)
    parser.set_defaults(func=run)


def message_sizes() -> dict[str, int]:
    """Header bytes of the requests and replies the floor mimics (2,048 blocks)."""
    session, rid, n = uuid.uuid4().hex, 100_000, TARGET_BLOCKS
    v = p.PROTOCOL_VERSION
    lookup = replies.LookupReply(id=rid, num_blocks=n, cpu=n, ssd=0, remote=0)
    plan = replies.LoadReply(
        id=rid,
        plan_id=rid,
        boot_id=uuid.uuid4().hex,
        ops=[replies.PlanOp(0, OpKind.H2D)],
        hit_blocks=n,
        cpu=n,
        ssd=0,
        remote=0,
    )
    return {
        "lookup_request": len(p.encode(p.Lookup(v=v, id=rid, session=session))),
        "lookup_reply": len(p.encode(lookup)),
        "plan_request": len(p.encode(p.Load(v=v, id=rid, session=session, skip=0))),
        "plan_reply": len(p.encode(plan)),
        "complete_request": len(
            p.encode(p.Complete(v=v, id=rid, session=session, plan_id=rid, op_ids=[0]))
        ),
    }


class EchoServer:
    """The floor's echo ROUTER, in a spawned process."""

    def __init__(self, path: Path, sizes: dict[str, int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.endpoint = f"ipc://{path}"
        ready, child = ctx.Pipe(duplex=False)
        args = (self.endpoint, sizes["lookup_reply"], sizes["plan_reply"], child)
        self.proc = ctx.Process(target=echo_main, args=args, name="bench-echo", daemon=True)
        self.proc.start()
        child.close()
        try:
            started = ready.poll(60) and ready.recv()
        except EOFError:  # it died first
            started = False
        ready.close()
        if not started:
            self.stop()
            raise RuntimeError(f"the echo server did not start (exit code {self.proc.exitcode})")

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(10)


def measure(
    fleet: Fleet,
    echo: str,
    sidecar: str,
    timing: Timing,
    rounds: int,
    sizes: dict[str, int],
    block_counts: tuple[int, ...] = BLOCK_COUNTS,
) -> dict[str, Any]:
    """Every latency figure: {figure: {blocks: {clients: summary}}}, hash_us and
    the rates. Each case runs `rounds` times for `timing.seconds`, in turn with
    the other cases of the same blocks and clients."""
    most = max(block_counts)
    kwargs = [{"endpoint": sidecar, "index": i, "gpu_blocks": most} for i in range(fleet.size)]
    fleet.call("connect", fleet.size, kwargs)
    (saved,) = fleet.call("presave", 1, [{"blocks": most}])
    if saved != most * 16:
        raise RuntimeError(f"pre-saving {most} blocks cached {saved} tokens")
    hash_timing = timing._replace(seconds=timing.seconds * rounds)
    out: dict[str, Any] = {"hash_us": {}}
    for n in block_counts:
        samples = fleet.call("hash", 1, [_args(n, hash_timing)], hash_timing.seconds + 60)
        out["hash_us"][str(n)] = _strip(summarize(samples))
    plan_sizes = {"endpoint": echo, "header_bytes": sizes["plan_request"], "with_ids": True}
    floors = {  # shape: (client task, its arguments)
        "lookup": (
            "ping",
            {"endpoint": echo, "header_bytes": sizes["lookup_request"], "with_ids": False},
        ),
        "load_save": ("ping", plan_sizes),
        "load_save_full": (
            "ping_full",
            {"endpoint": echo, "header_bytes": sizes["plan_request"],
             "complete_bytes": sizes["complete_request"]},
        ),
    }  # fmt: skip
    out["floor_rtt_us"] = {shape: {str(n): {} for n in block_counts} for shape in floors}
    for figure in SIDECAR_FIGURES:
        out[figure] = {str(n): {} for n in block_counts}
    # (where the summaries go, task, its arguments, the rate figure it gives at RATE_BLOCKS)
    cases = [
        (out["floor_rtt_us"][shape], task, kw, "raw" if shape == "lookup" else None)
        for shape, (task, kw) in floors.items()
    ]
    cases += [
        (out[figure], task, {}, RATE_FIGURES.get(figure))
        for figure, (task, _) in SIDECAR_FIGURES.items()
    ]
    rates: dict[str, dict[str, float]] = {"raw": {}, "lookup": {}, "lookup_keys": {}}
    for clients in CLIENT_COUNTS:
        for n in block_counts:
            print(f"{n:,} block(s), {clients} client(s) ...", file=sys.stderr, flush=True)
            tasks = [(task, {**_args(n, timing), **extra}) for _, task, extra, _ in cases]
            summaries = run_in_rounds(fleet, tasks, clients, rounds, timing.seconds + 60)
            for (table, _, _, rate), summary in zip(cases, summaries, strict=True):
                table[str(n)][str(clients)] = _strip(summary)
                if n == RATE_BLOCKS and rate is not None:
                    rates[rate][str(clients)] = summary["rate_rps"]
    n = TARGET_BLOCKS
    print(f"{n:,} blocks, 1 client: the lookup target's terms side by side ...", file=sys.stderr)
    kw = {"echo": echo, "header_bytes": sizes["lookup_request"], **_args(n, hash_timing)}
    (paired,) = fleet.call("lookup_paired", 1, [kw], hash_timing.seconds + 60)
    out["lookup_paired_us"] = {name: _strip(summarize([s])) for name, s in paired.items()}
    most_clients = max(CLIENT_COUNTS)
    print(f"{RATE_BLOCKS}-block rates, {most_clients} clients, side by side ...", file=sys.stderr)
    rate_rounds = 2 if rounds == 1 else RATE_ROUNDS
    rate_timing = timing._replace(seconds=hash_timing.seconds / rate_rounds)
    rate_tasks = {
        "raw": ("ping", {**_args(RATE_BLOCKS, rate_timing), **floors["lookup"][1]}),
        "lookup": ("lookup", _args(RATE_BLOCKS, rate_timing)),
        "lookup_keys": ("lookup_keys", _args(RATE_BLOCKS, rate_timing)),
    }
    wait = rate_timing.seconds + 60
    summaries = run_in_rounds(fleet, list(rate_tasks.values()), most_clients, rate_rounds, wait)
    out["rates_paired_rps"] = {
        name: s["rate_rps"] for name, s in zip(rate_tasks, summaries, strict=True)
    }
    (out["sidecar_requests"],) = fleet.call("sidecar_requests", 1, [{}])
    out["raw_rate_rps"] = rates["raw"]
    out["lookup_rate_rps"] = rates["lookup"]
    out["lookup_keys_rate_rps"] = rates["lookup_keys"]
    return out


def run_in_rounds(
    fleet: Fleet, tasks: list[tuple[str, dict]], clients: int, rounds: int, wait: float
) -> list[dict[str, float]]:
    """Each (task, kwargs) on `clients` processes, `rounds` times, every task in
    turn (each round starting one task later), so a burst of noise on the
    shared machine hits the floors and the sidecar cases alike; one summary
    per task over all its rounds."""
    parts: list[list[list[Samples]]] = [[[] for _ in range(clients)] for _ in tasks]
    for r in range(rounds):
        for j in range(len(tasks)):
            k = (r + j) % len(tasks)
            task, kwargs = tasks[k]
            for i, samples in enumerate(fleet.call(task, clients, [kwargs] * clients, wait)):
                parts[k][i].append(samples)
    return [summarize([Samples.merge(p) for p in per_client]) for per_client in parts]


def _block_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        msg = f"not a comma-separated list of integers: {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if any(not 1 <= n <= p.MAX_BLOCKS_PER_REQUEST for n in counts):
        raise argparse.ArgumentTypeError(
            f"block counts must be in [1, {p.MAX_BLOCKS_PER_REQUEST:,}], got {text!r}"
        )
    return counts


def _args(blocks: int, timing: Timing) -> dict[str, Any]:
    return {"blocks": blocks, "timing": timing}


def _strip(summary: dict[str, float]) -> dict[str, float]:
    """A latency summary without the rate (which, for cases with untimed work
    between calls, is not a closed-loop rate of the timed calls)."""
    return {k: v for k, v in summary.items() if k != "rate_rps"}


def derive(r: dict[str, Any]) -> None:
    """Add the ratios to the floors and the targets to result `r`."""
    r["vs_floor"] = {}
    for figure, (_, shape) in SIDECAR_FIGURES.items():
        floor = r["floor_rtt_us"][shape]
        r["vs_floor"][figure] = {
            n: {
                c: {q: s[q] / floor[n][c][q] for q in ("p50", "p99")} for c, s in by_clients.items()
            }
            for n, by_clients in r[figure].items()
        }
    r["vs_floor_uses"] = {
        figure: f"floor_rtt_us.{shape}" for figure, (_, shape) in SIDECAR_FIGURES.items()
    }
    r["lookup_rate_vs_raw"] = {
        c: r["lookup_rate_rps"][c] / r["raw_rate_rps"][c] for c in r["raw_rate_rps"]
    }
    r["lookup_keys_rate_vs_raw"] = {
        c: r["lookup_keys_rate_rps"][c] / r["raw_rate_rps"][c] for c in r["raw_rate_rps"]
    }
    n, most = str(TARGET_BLOCKS), str(max(CLIENT_COUNTS))
    paired = {name: s["p50"] for name, s in r["lookup_paired_us"].items()}
    limit = paired["floor"] + paired["hash"] + LOOKUP_SLACK_US
    after_limit = paired["floor_after_hash"] + paired["hash"] + LOOKUP_SLACK_US
    floor, hashing = r["floor_rtt_us"]["lookup"][n]["1"]["p50"], r["hash_us"][n]["p50"]
    separate = r["lookup_rtt_us"][n]["1"]["p50"]
    paired_rates = r["rates_paired_rps"]
    for name in ("lookup", "lookup_keys"):
        paired_rates[f"{name}_vs_raw"] = paired_rates[name] / paired_rates["raw"]
    ratio, separate_ratio = paired_rates["lookup_vs_raw"], r["lookup_rate_vs_raw"][most]
    r["targets"] = {
        "lookup_2048_p50_us": {
            "value": paired["lookup"],
            "limit": limit,
            "rule": f"<= floor p50 ({paired['floor']:.1f}) + hashing p50 "
            f"({paired['hash']:.1f}) + {LOOKUP_SLACK_US:g} us, 1 client, the three "
            "measured side by side (lookup_paired_us)",
            "within": paired["lookup"] <= limit,
            "from_separate_cases": {
                "value": separate,
                "limit": floor + hashing + LOOKUP_SLACK_US,
                "within": separate <= floor + hashing + LOOKUP_SLACK_US,
            },
            "with_floor_after_hash": {
                "value": paired["lookup"],
                "limit": after_limit,
                "within": paired["lookup"] <= after_limit,
            },
        },
        "lookup_rate_4_clients_vs_raw": {
            "value": ratio,
            "limit": RATE_TARGET,
            "rule": f">= {RATE_TARGET:g} x the raw closed-loop rate of {most} clients, "
            f"{RATE_BLOCKS} blocks, the two measured side by side (rates_paired_rps)",
            "within": ratio >= RATE_TARGET,
            "from_separate_cases": {
                "value": separate_ratio,
                "within": separate_ratio >= RATE_TARGET,
            },
        },
    }


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:  # the clients need it; this process does not
        print("bench control needs torch: pip install -e '.[torch]'", file=sys.stderr)
        return 2
    seconds = args.seconds or (0.03 if args.quick else 1.5)
    if seconds <= 0:
        print("--seconds must be > 0", file=sys.stderr)
        return 2
    if args.calls_only:
        return run_calls_only(args)
    rounds = 1 if args.quick else ROUNDS
    timing = Timing(seconds, 2, 3) if args.quick else Timing(seconds / rounds, 10, 20)
    sizes = message_sizes()
    workdir = Path(tempfile.mkdtemp(prefix="kvsbench-"))
    block_counts = tuple(sorted({*BLOCK_COUNTS, *args.blocks}))
    # The lookup set and each client's saves, with room to spare.
    slots = (1 + max(CLIENT_COUNTS)) * max(block_counts) * 5 // 4
    capacity = max(MIN_CAPACITY, slots * SLOT_BYTES)
    sidecar = LocalSidecar(
        workdir, cpu_capacity=str(capacity), settings=BENCH_SIDECAR_SETTINGS, tag="bench"
    )
    fleet: Fleet | None = None
    echo: EchoServer | None = None
    try:
        fleet = Fleet(ControlClient, max(CLIENT_COUNTS))
        echo = EchoServer(workdir / "echo.sock", sizes)
        sidecar.start()
        result = measure(
            fleet, echo.endpoint, sidecar.endpoint, timing, rounds, sizes, block_counts
        )
        fleet.close()  # unregisters every client while the sidecar still runs
    finally:
        if fleet is not None:
            fleet.close()
        if echo is not None:
            echo.stop()
        exit_code = sidecar.stop()
        log_tail = sidecar.log_tail() if exit_code != 0 else ""
        leftovers = sidecar.remove_leftovers()
        shutil.rmtree(workdir, ignore_errors=True)
    print("measuring header encodings ...", file=sys.stderr, flush=True)
    result.update(measure_codecs(0.01 if args.quick else 0.1))
    derive(result)
    if not args.no_calls:
        result["calls"] = run_calls(args.quick, args.seconds, not args.no_peers)
        result["targets"].update(result["calls"].pop("targets"))
    result.update(
        {
            "message_header_bytes": sizes,
            "kv_block_bytes": BLOCK_BYTES,
            "block_counts": list(block_counts),
            "client_counts": list(CLIENT_COUNTS),
            "rate_blocks": RATE_BLOCKS,
            "seconds_per_case": seconds,
            "rounds_per_case": rounds,
            "quick": bool(args.quick),
            "sidecar_instance": sidecar.instance,
            "about": ABOUT,
            "sidecar_exit_code": exit_code,
            "shm_leftovers": leftovers,
        }
    )
    print_report(result)
    if "calls" in result:
        print()
        print_calls({**result["calls"], "targets": result["targets"]})
    if args.json:
        write_json(args.json, result)
    if exit_code != 0 or leftovers:
        print(
            f"kvsidecar bench control: the sidecar exited with {exit_code} and left "
            f"{len(leftovers)} shm segment(s) (removed); its log ends:\n{log_tail}",
            file=sys.stderr,
        )
        return 1
    return 0
