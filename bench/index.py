"""`kvsidecar bench index`: RadixIndex insert/match speed, memory and eviction cost.

The tree is shaped like the Mooncake conversation trace: each sequence is a
prefix of an earlier one, cut at a 512-token boundary, plus fresh 512-token
units of 32 blocks each. Each size is measured in a forked child process.

Memory per cached block is reported two ways: `bytes_per_block_*` from
tracemalloc (every Python object and numpy buffer the index allocated, a
second build of the same tree), and `rss_bytes_per_block_*` from psutil (RSS
after the timed build minus before, after handing freed heap back with
malloc_trim; includes allocator slack, excludes the input keys). Insert
throughput times `insert()` calls only; each sequence's present prefix is
found with an untimed `match()` first, as a PUT does.

Eviction cost: each size evicts its oldest 10% of blocks (LRU, batches of
256) from a fresh build, over enough rounds to evict 200,000 blocks in all;
the figure is the median round. The large/small ratio shows how the cost
grows with the index (O(log n) in candidates, plus cache misses).

Floors measured in the same run: memory against the raw 24 bytes a block
must hold (16-byte key + 8-byte slot); the 2,048-block match against a Python
dict walked key by key (the per-key design the radix runs avoid).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import heapq
import multiprocessing
import random
import statistics
import sys
import time
import tracemalloc
from typing import Any

import numpy as np
import psutil

from bench.keys import measure_hashing
from bench.targets import Target, at_most, verdict
from cachesim.report import positive_int_list, print_table, write_json
from cachesim.trace import expand_ids
from contract.ids import keys_from_ints
from sidecar.control.index import RadixIndex
from sidecar.control.policies import make_policy

BLOCKS_PER_UNIT = 32  # 512-token units of 16-token blocks, as in the trace
RAW_BYTES_PER_BLOCK = 16 + 8
MATCH_BLOCKS = 2048
EVICT_BATCH = 256
BYTES_LIMIT, BYTES_LIMIT_FROM = 256.0, 5_000_000
"""Traced bytes per cached block, at indexes of BYTES_LIMIT_FROM blocks or more."""
MATCH_US_LIMIT = 200.0
"""A 2,048-block match, µs."""
EVICT_GROWTH_LIMIT = 2.0
"""Eviction per block at the large size over the small one."""
HASH_MS_LIMIT = 1.5
"""Hashing 32,768 tokens into 2,048 chained keys, ms."""
EVICT_FRACTION = 0.1  # each size evicts the same share of its blocks: its oldest leaves
EVICT_MIN_ROUNDS = 9
EVICT_MIN_BLOCKS = 200_000  # per size, over all rounds: small trees get more rounds
PROGRESS_EVERY = 5.0  # seconds between progress lines on stderr


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "index",
        help="RadixIndex insert/match throughput, memory per block, eviction cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        type=positive_int_list,
        default=None,
        help="cached-block counts for throughput and memory (default 1000000,5000000)",
    )
    p.add_argument(
        "--evict-sizes",
        type=positive_int_list,
        default=None,
        help="small,large cached-block counts for eviction cost (default 50000,5000000)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, for the test suite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


# ---- workload ------------------------------------------------------------------


class Workload:
    """Sequences as one flat key array with offsets; `num_blocks` distinct blocks."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        rng = random.Random(seed)
        units: list[list[int]] = []
        fresh = 0
        target_units = max(1, -(-num_blocks // BLOCKS_PER_UNIT))
        while fresh < target_units:
            prefix: list[int] = []
            if units and rng.random() < 0.8:
                base = units[rng.randrange(len(units))]
                prefix = base[: rng.randint(1, len(base))]
            n_new = min(1 + int(rng.expovariate(1 / 6)), target_units - fresh)
            units.append(prefix + list(range(fresh, fresh + n_new)))
            fresh += n_new
        lengths = np.array([len(u) for u in units], dtype=np.int64) * BLOCKS_PER_UNIT
        self.offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        flat = np.fromiter(
            (x for u in units for x in u), np.int64, int(lengths.sum()) // BLOCKS_PER_UNIT
        )
        self.keys = keys_from_ints(expand_ids(flat, BLOCKS_PER_UNIT), high=seed + 1)
        self.num_blocks = fresh * BLOCKS_PER_UNIT

    @property
    def num_sequences(self) -> int:
        return self.offsets.size - 1

    def sequence(self, i: int) -> np.ndarray:
        return self.keys[self.offsets[i] : self.offsets[i + 1]]


def build(index: RadixIndex, work: Workload, namespaces: int = 0) -> tuple[float, int]:
    """Insert every sequence; returns (seconds inside insert, blocks inserted).
    With `namespaces`, sequence i goes to namespace 1 + i % namespaces (its
    keys made distinct per namespace, as salted keys are)."""
    spent = 0.0
    slot = 0
    inserted = 0
    all_slots = np.arange(work.num_blocks, dtype=np.int64)
    for i in range(work.num_sequences):
        keys, ns = work.sequence(i), 0
        if namespaces:
            ns = 1 + i % namespaces
            keys = _salted(keys, ns)
        num_new = keys.size - index.match(keys).num_blocks
        if num_new == 0:
            continue
        slots = all_slots[slot : slot + num_new]
        if slots.size < num_new:  # sequences of other namespaces share no prefix
            slots = np.arange(slot, slot + num_new, dtype=np.int64)
        start = time.perf_counter()
        index.insert(keys, slots, ready=True, ns=ns)
        spent += time.perf_counter() - start
        slot += num_new
        inserted += num_new
    return spent, inserted


def match_all(index: RadixIndex, work: Workload) -> tuple[float, int]:
    matched = 0
    start = time.perf_counter()
    for i in range(work.num_sequences):
        matched += index.match(work.sequence(i)).num_blocks
    return time.perf_counter() - start, matched


def _salted(keys: np.ndarray, ns: int) -> np.ndarray:
    """The keys made distinct per namespace, as salted keys are: their low 64
    bits xored with a constant whose high bits differ per namespace (the
    workload's ids are small, so no two namespaces share a key)."""
    halves = keys.view(np.uint64).reshape(-1, 2).copy()
    halves[:, 0] ^= np.uint64((ns * 0x9E3779B97F4A7C15) & (2**64 - 1) | (1 << 63))
    return halves.reshape(-1).view(keys.dtype)


NAMESPACE_COUNTS = (1, 8)
"""`namespace_*` figures: the same tree spread over this many namespaces."""


def measure_namespaces(num_blocks: int, seed: int, rounds: int = 3) -> dict[str, float]:
    """Match and eviction speed with the tree's sequences spread over 1 and 8
    namespaces (one sidecar serving many models and tenants): match walks
    one namespace's tree either way; eviction picks, per victim, the
    namespace whose next victim is oldest."""
    work = Workload(num_blocks, seed)
    out: dict[str, float] = {}
    for k in NAMESPACE_COUNTS:
        match_rates, evict_us = [], []
        for _ in range(rounds):
            index = RadixIndex(make_policy("lru"), clock=_counter())
            build(index, work, namespaces=k)
            seqs = [_salted(work.sequence(i), 1 + i % k) for i in range(work.num_sequences)]
            start = time.perf_counter()
            matched = sum(index.match(keys).num_blocks for keys in seqs)
            match_rates.append(matched / (time.perf_counter() - start))
            spent, _, runs = timed_evict(index, max(1, num_blocks // 10))
            evict_us.append(spent / max(runs, 1))
            del index
        out[f"namespace_match_blocks_per_s_{k}"] = statistics.median(match_rates)
        out[f"namespace_evict_us_per_node_{k}"] = statistics.median(evict_us)
    return out


def long_sequence(index: RadixIndex, seed: int) -> tuple[np.ndarray, int]:
    """Insert a 2,048-block conversation with a branch at every 512-token
    boundary (one node per unit on its path: the slow case). Returns its keys
    and the number of nodes on its path."""
    units = MATCH_BLOCKS // BLOCKS_PER_UNIT
    ids = expand_ids(np.arange(units, dtype=np.int64), BLOCKS_PER_UNIT)
    keys = keys_from_ints(ids, high=(seed + 1) << 32)
    branch = keys_from_ints(np.arange(units, dtype=np.int64), high=(seed + 2) << 32)
    slot = 10**12
    for u in range(units):
        end = (u + 1) * BLOCKS_PER_UNIT
        present = index.match(keys[:end]).num_blocks
        index.insert(keys[:end], np.arange(slot, slot + end - present), ready=True)
        slot += end
        fork = np.concatenate([keys[:end], branch[u : u + 1]])
        index.insert(fork, np.array([slot]), ready=True)
        slot += 1
    nodes = 0
    node = index.match(keys).node
    while node is not None and node.parent is not None:
        nodes += 1
        node = node.parent
    return keys, nodes


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def evict_cost(work: Workload, total: int, rounds: int) -> dict[str, float]:
    """Fill a fresh index with `work`, evict `total` blocks in batches of
    EVICT_BATCH; the median over `rounds` fills of µs per evicted block and
    per evicted node (a node may be cut and counted again). The cyclic
    garbage collector is paused while timing: a pass over the build's
    leftovers is not eviction work."""
    per_block, per_node = [], []
    candidates = 0
    for _ in range(rounds):
        index = RadixIndex(make_policy("lru"), clock=_counter())
        build(index, work)
        candidates = index.policy.num_candidates
        spent, evicted, runs = timed_evict(index, total)
        per_block.append(spent / max(evicted, 1))
        per_node.append(spent / max(runs, 1))
        del index
        gc.collect()
    return {
        "evict_us_per_block": statistics.median(per_block),
        "evict_us_per_node": statistics.median(per_node),
        "evict_candidates": candidates,
        "heap_floor_us": heap_floor_us(candidates),
    }


def timed_evict(index: RadixIndex, total: int) -> tuple[float, int, int]:
    """Evict `total` blocks in batches of EVICT_BATCH; (µs spent, blocks
    evicted, runs evicted). The cyclic garbage collector is paused while
    timing: a pass over the build's leftovers is not eviction work."""
    evicted = runs = 0
    gc.collect()
    gc.disable()
    start = time.perf_counter()
    while evicted < total:
        result = index.evict(min(EVICT_BATCH, total - evicted))
        if result.num_blocks == 0:
            break
        evicted += result.num_blocks
        runs += len(result.runs)
    spent = (time.perf_counter() - start) * 1e6
    gc.enable()
    return spent, evicted, runs


def heap_floor_us(size: int, ops: int = 2000, rounds: int = 5) -> float:
    """Floor for one eviction: µs per heappop + heappush on a heapq of `size`
    entries shaped like the policy's ((last_access, seq), token, node)."""

    class Item:
        __slots__ = ()

    rng = random.Random(size)
    times = []
    for _ in range(rounds):
        heap = [((rng.random() * size, i), i, Item()) for i in range(max(size, 1))]
        heapq.heapify(heap)
        start = time.perf_counter()
        for i in range(ops):
            (when, _), token, item = heapq.heappop(heap)
            heapq.heappush(heap, ((when + size, i), token, item))
        times.append((time.perf_counter() - start) * 1e6 / ops)
    return statistics.median(times)


# ---- one size, in a child process ----------------------------------------------


def measure_size(num_blocks: int, seed: int, with_match: bool) -> dict[str, Any]:
    """Build timings and memory at one size (+ the 2,048-block match)."""
    work = Workload(num_blocks, seed)
    _release_free_memory()
    proc = psutil.Process()
    index = RadixIndex(make_policy("lru"), clock=_counter())
    rss_before = proc.memory_info().rss
    insert_s, inserted = build(index, work)
    gc.collect()
    rss_delta = proc.memory_info().rss - rss_before
    match_s, matched = match_all(index, work)
    out: dict[str, Any] = {
        "num_blocks": index.num_blocks,
        "num_nodes": index.num_nodes,
        "num_sequences": work.num_sequences,
        "rss_bytes_per_block": rss_delta / max(index.num_blocks, 1),
        "insert_blocks_per_s": inserted / insert_s if insert_s else 0.0,
        "match_blocks_per_s": matched / match_s if match_s else 0.0,
    }
    if with_match:
        keys, path_nodes = long_sequence(index, seed)
        out["match_us_2048"] = median_us(lambda: index.match(keys), 200)
        out["match_2048_path_nodes"] = path_nodes
        table = {keys[i].tobytes(): i for i in range(keys.size)}
        key_list = [keys[i].tobytes() for i in range(keys.size)]
        out["floor_us_dict_2048"] = median_us(lambda: [table.get(k) for k in key_list], 200)
    del index
    gc.collect()
    tracemalloc.start()
    index = RadixIndex(make_policy("lru"), clock=_counter())
    traced_before = tracemalloc.get_traced_memory()[0]
    build(index, work)
    out["traced_bytes_per_block"] = (tracemalloc.get_traced_memory()[0] - traced_before) / max(
        index.num_blocks, 1
    )
    tracemalloc.stop()
    return out


def measure_evict(num_blocks: int, seed: int, total: int, rounds: int) -> dict[str, float]:
    return evict_cost(Workload(num_blocks, seed), total, rounds)


def _release_free_memory() -> None:
    """Hand freed heap back to the OS, so the RSS delta counts only new pages."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS may undercount
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _counter():
    tick = iter(range(1, 1 << 62))
    return lambda: float(next(tick))


def _child(conn, fn, args) -> None:
    try:
        conn.send(fn(*args))
    except BaseException as exc:
        conn.send(exc)
    finally:
        conn.close()


def isolated(fn, *args, label: str = "", every: float = PROGRESS_EVERY):
    """fn(*args) in a forked child: each size starts from a clean heap. While
    it runs, a line `label, N s` goes to stderr every `every` seconds."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    start = time.monotonic()
    print(f"{label} ...", file=sys.stderr, flush=True)
    proc.start()
    child.close()
    while not parent.poll(every):
        print(f"{label}, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    result = parent.recv()
    proc.join()
    if isinstance(result, BaseException):
        raise result
    return result


# ---- command -------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    sizes = args.sizes or ([20_000, 100_000] if args.quick else [1_000_000, 5_000_000])
    evict_sizes = args.evict_sizes or ([5_000, 100_000] if args.quick else [50_000, 5_000_000])
    if len(sizes) != 2 or len(evict_sizes) != 2:
        raise SystemExit("--sizes and --evict-sizes take two sizes each: small,large")

    by_size = {}
    for n in sizes:
        label = f"bench index: building {n:,} blocks"
        by_size[n] = isolated(measure_size, n, args.seed, n == sizes[1], label=label)
    evict = {}
    evict_blocks, evict_rounds = {}, {}
    for n in evict_sizes:
        evict_blocks[n] = max(1, int(n * EVICT_FRACTION))
        evict_rounds[n] = (
            3
            if args.quick  # the suite only checks that the figures come out
            else max(EVICT_MIN_ROUNDS, -(-EVICT_MIN_BLOCKS // evict_blocks[n]))
        )
        label = f"bench index: evicting {evict_blocks[n]:,} of {n:,} blocks x {evict_rounds[n]}"
        evict[n] = isolated(
            measure_evict, n, args.seed, evict_blocks[n], evict_rounds[n], label=label
        )

    large = by_size[sizes[1]]
    result: dict[str, Any] = {
        # The "1m" / "5m" names hold the two --sizes (smaller with --quick).
        "bytes_per_block_1m": by_size[sizes[0]]["traced_bytes_per_block"],
        "bytes_per_block_5m": large["traced_bytes_per_block"],
        "rss_bytes_per_block_1m": by_size[sizes[0]]["rss_bytes_per_block"],
        "rss_bytes_per_block_5m": large["rss_bytes_per_block"],
        "memory_method": (
            "bytes_per_block: tracemalloc (Python objects and numpy buffers the index "
            "allocated); rss_bytes_per_block: psutil RSS delta around the build, "
            "in a forked child after malloc_trim"
        ),
        "raw_bytes_per_block": RAW_BYTES_PER_BLOCK,
        "insert_blocks_per_s": large["insert_blocks_per_s"],
        "match_blocks_per_s": large["match_blocks_per_s"],
        "match_us_2048": large["match_us_2048"],
        "match_2048_path_nodes": large["match_2048_path_nodes"],
        "floor_us_dict_2048": large["floor_us_dict_2048"],
        "evict_us_per_block_small": evict[evict_sizes[0]]["evict_us_per_block"],
        "evict_us_per_block_large": evict[evict_sizes[1]]["evict_us_per_block"],
        "evict_us_per_node_small": evict[evict_sizes[0]]["evict_us_per_node"],
        "evict_us_per_node_large": evict[evict_sizes[1]]["evict_us_per_node"],
        "evict_candidates_small": evict[evict_sizes[0]]["evict_candidates"],
        "evict_candidates_large": evict[evict_sizes[1]]["evict_candidates"],
        "heap_floor_us_small": evict[evict_sizes[0]]["heap_floor_us"],
        "heap_floor_us_large": evict[evict_sizes[1]]["heap_floor_us"],
        "evict_fraction": EVICT_FRACTION,
        "evict_blocks_small": evict_blocks[evict_sizes[0]],
        "evict_blocks_large": evict_blocks[evict_sizes[1]],
        "evict_rounds_small": evict_rounds[evict_sizes[0]],
        "evict_rounds_large": evict_rounds[evict_sizes[1]],
        "evict_batch": EVICT_BATCH,
        "sizes": sizes,
        "evict_sizes": evict_sizes,
        "by_size": {str(n): v for n, v in by_size.items()},
        "quick": bool(args.quick),
        "seed": args.seed,
    }
    result["evict_ratio_large_small"] = (
        result["evict_us_per_block_large"] / result["evict_us_per_block_small"]
    )
    result["evict_node_ratio_large_small"] = (
        result["evict_us_per_node_large"] / result["evict_us_per_node_small"]
    )
    result["heap_floor_ratio_large_small"] = (
        result["heap_floor_us_large"] / result["heap_floor_us_small"]
    )
    label = f"bench index: {sizes[0]:,} blocks over 1 and 8 namespaces"
    result.update(isolated(measure_namespaces, sizes[0], args.seed, label=label))
    print("bench index: hashing block keys ...", file=sys.stderr, flush=True)
    result.update(measure_hashing())
    result["targets"] = targets(result)
    print_table(("figure", "value", "target", "note"), _rows(result))
    print(verdict(result["targets"]))
    if args.json:
        write_json(args.json, result)
    return 0


def targets(r: dict[str, Any]) -> dict[str, Target]:
    out: dict[str, Target] = {}
    for n, s in r["by_size"].items():
        if int(n) >= BYTES_LIMIT_FROM:
            rule = f"bytes per cached block (tracemalloc) <= {BYTES_LIMIT:g}"
            out[f"bytes_per_block_{n}"] = at_most(s["traced_bytes_per_block"], BYTES_LIMIT, rule)
    rule = f"median 2,048-block match, µs, <= {MATCH_US_LIMIT:g}"
    out["match_us_2048"] = at_most(r["match_us_2048"], MATCH_US_LIMIT, rule)
    rule = f"eviction per block at the large size / at the small one <= {EVICT_GROWTH_LIMIT:g}"
    out["evict_ratio_large_small"] = at_most(r["evict_ratio_large_small"], EVICT_GROWTH_LIMIT, rule)
    rule = f"hashing 32,768 tokens into 2,048 chained keys (the one used), ms, <= {HASH_MS_LIMIT:g}"
    out["hash_ms_2048_keys"] = at_most(r["hash_ms_blake2b"], HASH_MS_LIMIT, rule)
    return out


def _rows(r: dict[str, Any]) -> list[tuple]:
    (small, large), (esmall, elarge) = r["sizes"], r["evict_sizes"]
    rows = []
    for n in (small, large):
        s = r["by_size"][str(n)]
        target = BYTES_LIMIT if n >= BYTES_LIMIT_FROM else None
        traced = s["traced_bytes_per_block"]
        note = f"{traced / RAW_BYTES_PER_BLOCK:.1f}x raw 24 B; {s['num_nodes']:,} nodes"
        rows.append((f"bytes/block at {n:,} (tracemalloc)", traced, target, note))
        rows.append((f"bytes/block at {n:,} (RSS delta)", s["rss_bytes_per_block"], target, ""))
    rows += [
        ("insert blocks/s", r["insert_blocks_per_s"], None, f"at {large:,} blocks"),
        ("match blocks/s", r["match_blocks_per_s"], None, f"at {large:,} blocks"),
        (
            "match 2,048 blocks (us)",
            r["match_us_2048"],
            MATCH_US_LIMIT,
            f"{r['match_2048_path_nodes']} nodes on path; "
            f"{r['match_us_2048'] / r['floor_us_dict_2048']:.2f}x a per-key dict walk",
        ),
        (
            f"evict us/block at {esmall:,}",
            r["evict_us_per_block_small"],
            None,
            f"{r['evict_us_per_node_small']:.1f} us per evicted node",
        ),
        (
            f"evict us/block at {elarge:,}",
            r["evict_us_per_block_large"],
            None,
            f"{r['evict_us_per_node_large']:.1f} us per evicted node",
        ),
        (
            "evict ratio large/small",
            r["evict_ratio_large_small"],
            EVICT_GROWTH_LIMIT,
            f"per node {r['evict_node_ratio_large_small']:.2f}; a bare heapq pop+push "
            f"({r['evict_candidates_small']:,} vs {r['evict_candidates_large']:,} "
            f"entries) {r['heap_floor_ratio_large_small']:.2f}",
        ),
    ]
    for k in NAMESPACE_COUNTS[1:]:
        match1, evict1 = r["namespace_match_blocks_per_s_1"], r["namespace_evict_us_per_node_1"]
        matchk = r[f"namespace_match_blocks_per_s_{k}"]
        evictk = r[f"namespace_evict_us_per_node_{k}"]
        rows += [
            (
                f"match blocks/s, {k} namespaces",
                matchk,
                None,
                f"{matchk / match1:.2f}x one namespace's ({match1:.3g}) at {small:,} blocks",
            ),
            (
                f"evict us/node, {k} namespaces",
                evictk,
                None,
                f"{evictk / evict1:.2f}x one namespace's ({evict1:.2f})",
            ),
        ]
    floor = f"{r['floor_ms_blake2b_bulk']:.3f} ms bulk blake2b of the same tokens"
    rows += [
        (
            "hash 32,768 tokens, blake2b (ms)",
            r["hash_ms_blake2b"],
            HASH_MS_LIMIT,
            f"{r['blake2b_impl']}; {r['blake2b_vs_floor']:.2f}x the floor: {floor}",
        ),
        (
            "hash 32,768 tokens, blake2b python (ms)",
            r["hash_ms_blake2b_python"],
            HASH_MS_LIMIT,
            "hashlib",
        ),
        ("hash 32,768 tokens, xxh3_128 (ms)", r["hash_ms_xxh3_128"], HASH_MS_LIMIT, ""),
    ]
    return [
        (name, value, "" if target is None else f"<= {target:g}", _note(value, target, note))
        for name, value, target, note in rows
    ]


def _note(value: float, target: float | None, note: str) -> str:
    if target is None:
        return note
    where = "within" if value <= target else "over"
    return f"{where} target; {note}" if note else f"{where} target"
