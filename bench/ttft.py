"""`kvsidecar bench ttft`: time to first token with a CPU-tier hit against a
full recompute, for a small Llama on the CPU (engine_shim.hf.CachedLM).

Workload. The Mooncake conversation trace's follow-ups (requests that share
at least half of their 512-token hash blocks with an earlier request: later
turns of a conversation) give prompt lengths and the share of each prompt an
earlier turn left in the cache. Lengths are divided by 8 for a 4-layer model
on a CPU: a 512-token trace block becomes 64 tokens (4 KV blocks of 16), a
16k-token prompt 2k tokens. Each hash id names 64 token ids drawn from a
generator seeded by the id, so requests that share ids share tokens. For
each target length, follow-ups within 0.8-1.25x of it are taken; the prefix
they share with the earlier request is prefilled first (its blocks are saved
to the CPU tier), then the follow-up is timed.

Timing. TTFT = lookup + load + forward until the last token's logits; the
save after it is not on the first token's path (hits run with save=False,
so one hit can be repeated). The floor is a recompute by the same model
without the cache, one forward over the whole prompt, measured alternately
with the hit in the same run. Medians of --repeats; the table's speedup is
recompute / hit.

Break-even. Prompts of growing length (whole blocks and one token) whose
every full block is cached (a repeated or resumed prompt, the best case for a
hit): the break-even length is the shortest swept length from which on
every hit is faster than the recompute.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import positive_int_list, print_table, write_json
from bench.trace import MOONCAKE_BLOCK_TOKENS, load_mooncake

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl"
SCALE = 8
UNIT = MOONCAKE_BLOCK_TOKENS // SCALE  # tokens per trace hash id after scaling
MIN_REUSE = 0.5  # a follow-up shares at least this share of its hash ids
TARGETS = (256, 512, 1024, 2048, 4096)
QUICK_TARGETS = (256, 1024)
# Whole blocks plus one token: a hit loads every block and computes one token.
SWEEP = (17, 33, 49, 65, 97, 129, 193, 257, 385, 513)
QUICK_SWEEP = (17, 33, 65, 129)
TOKENS_PER_BLOCK = 16


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ttft",
        help="time to first token: CPU-tier hit vs full recompute (tiny Llama, CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument(
        "--lengths",
        type=positive_int_list,
        default=None,
        help="target prompt lengths after scaling (default " + ",".join(map(str, TARGETS)) + ")",
    )
    p.add_argument(
        "--sweep",
        type=positive_int_list,
        default=None,
        help="break-even sweep lengths (default " + ",".join(map(str, SWEEP)) + ")",
    )
    p.add_argument("--samples", type=int, default=None, help="follow-ups per length (default 3)")
    p.add_argument("--repeats", type=int, default=None, help="timings per case (default 7)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    p.add_argument("--quick", action="store_true", help="few small cases, for the test suite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


# ---- workload ------------------------------------------------------------------


@dataclass(frozen=True)
class FollowUp:
    request: int
    """Its index in the trace."""
    trace_tokens: int
    hash_ids: np.ndarray
    shared_ids: int
    """Leading hash ids an earlier request had."""

    @property
    def tokens(self) -> int:
        """Prompt length after scaling."""
        return min(-(-self.trace_tokens // SCALE), self.hash_ids.size * UNIT)

    @property
    def cacheable(self) -> int:
        """Leading tokens an earlier turn cached: the shared ids' tokens, full blocks only."""
        shared = min(self.shared_ids * UNIT, self.tokens - 1)
        return shared // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK


def follow_ups(path: Path) -> list[FollowUp]:
    """Every request sharing at least MIN_REUSE of its hash ids with an
    earlier one. Hash ids are prefix-chained, so a leading id seen before
    means the whole prefix up to it was seen before."""
    trace = load_mooncake(path)
    seen: set[int] = set()
    out = []
    for r in range(trace.num_requests):
        ids = trace.hash_ids[trace.hash_offsets[r] : trace.hash_offsets[r + 1]]
        shared = 0
        while shared < ids.size and int(ids[shared]) in seen:
            shared += 1
        if ids.size and shared / ids.size >= MIN_REUSE:
            out.append(FollowUp(r, int(trace.input_lengths[r]), ids, shared))
        seen.update(int(h) for h in ids)
    return out


def pick(candidates: list[FollowUp], target: int, k: int, seed: int) -> list[FollowUp]:
    """Up to k follow-ups whose scaled length is within 0.8-1.25x of `target`."""
    near = [f for f in candidates if 0.8 * target <= f.tokens <= 1.25 * target and f.cacheable]
    return sorted(random.Random(seed + target).sample(near, min(k, len(near))), key=_request)


def _request(f: FollowUp) -> int:
    return f.request


def prompt_tokens(hash_ids: np.ndarray, length: int, vocab: int) -> np.ndarray:
    """`length` token ids: UNIT ids per hash id, drawn from a generator seeded by it."""
    parts = [np.random.default_rng(int(h)).integers(0, vocab, UNIT) for h in hash_ids]
    return np.concatenate(parts)[:length]


# ---- timing --------------------------------------------------------------------


def time_hit(lm: Any, ids: np.ndarray, expected: int, repeats: int) -> dict[str, Any]:
    """A hit (loads, saves nothing) and a recompute, alternately; medians in ms.
    `expected`: the tokens the hit should load."""
    lm.prefill(ids, use_sidecar=False)  # first-call costs of this shape out of the timings
    hits, recomputes = [], []
    for _ in range(repeats):
        hits.append(lm.prefill(ids, save=False).info)
        recomputes.append(lm.prefill(ids, use_sidecar=False).info)
    hit_ms = statistics.median(i.ttft_s for i in hits) * 1e3
    recompute_ms = statistics.median(i.ttft_s for i in recomputes) * 1e3
    return {
        "prompt_tokens": int(ids.size),
        "expected_tokens": expected,
        "loaded_tokens": hits[-1].loaded_tokens,
        "loaded_from_cpu": hits[-1].loaded_from.cpu,
        "hit_ms": hit_ms,
        "hit_lookup_ms": statistics.median(i.lookup_s for i in hits) * 1e3,
        "hit_load_ms": statistics.median(i.load_s for i in hits) * 1e3,
        "hit_compute_ms": statistics.median(i.compute_s for i in hits) * 1e3,
        "hit_ms_all": [i.ttft_s * 1e3 for i in hits],
        "recompute_ms": recompute_ms,
        "recompute_ms_all": [i.ttft_s * 1e3 for i in recomputes],
        "speedup": recompute_ms / hit_ms,
    }


def measure_lengths(
    lm: Any, candidates: list[FollowUp], targets: list[int], k: int, repeats: int, seed: int
) -> list[dict[str, Any]]:
    vocab = lm.model.config.vocab_size
    out = []
    for target in targets:
        chosen = pick(candidates, target, k, seed)
        if not chosen:
            print(f"no follow-up of ~{target} tokens in the trace", file=sys.stderr)
            continue
        print(f"length ~{target}: {len(chosen)} follow-up(s) ...", file=sys.stderr, flush=True)
        samples = []
        for f in chosen:
            ids = prompt_tokens(f.hash_ids, f.tokens, vocab)
            lm.prefill(ids[: f.cacheable])  # the earlier turn: its blocks go to the CPU tier
            sample = time_hit(lm, ids, f.cacheable, repeats)
            samples.append({"request": f.request, "trace_tokens": f.trace_tokens, **sample})
        out.append(_summary(target, samples))
    return out


def measure_sweep(lm: Any, lengths: list[int], repeats: int, seed: int) -> list[dict[str, Any]]:
    vocab = lm.model.config.vocab_size
    rng = np.random.default_rng(seed)
    out = []
    print(f"break-even sweep over {len(lengths)} lengths ...", file=sys.stderr, flush=True)
    for n in lengths:
        ids = rng.integers(0, vocab, n)
        lm.prefill(ids)  # every full block is cached
        out.append(time_hit(lm, ids, (n - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK, repeats))
    return out


def break_even(sweep: list[dict[str, Any]]) -> int | None:
    """The shortest swept length from which on every hit beats the recompute."""
    found = None
    for row in sorted(sweep, key=_prompt_tokens, reverse=True):
        if row["hit_ms"] >= row["recompute_ms"]:
            break
        found = row["prompt_tokens"]
    return found


def _prompt_tokens(row: dict[str, Any]) -> int:
    return int(row["prompt_tokens"])


def _summary(target: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return float(statistics.median(s[key] for s in samples))

    hit, recompute = med("hit_ms"), med("recompute_ms")
    return {
        "target_tokens": target,
        "prompt_tokens": med("prompt_tokens"),
        "trace_tokens": med("trace_tokens"),
        "loaded_tokens": med("loaded_tokens"),
        "cached_share": float(
            statistics.median(s["loaded_tokens"] / s["prompt_tokens"] for s in samples)
        ),
        "hit_ms": hit,
        "hit_lookup_load_ms": med("hit_lookup_ms") + med("hit_load_ms"),
        "hit_compute_ms": med("hit_compute_ms"),
        "recompute_ms": recompute,
        "speedup": recompute / hit,
        "samples": samples,
    }


# ---- command -------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        import torch

        from engine_shim.client import KVClient
        from engine_shim.hf import CachedLM, kv_block_bytes, tiny_llama
    except ImportError:
        print("bench ttft needs torch and transformers: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    from engine_shim.local_sidecar import LocalSidecar

    if args.threads:
        torch.set_num_threads(args.threads)
    targets = args.lengths or list(QUICK_TARGETS if args.quick else TARGETS)
    sweep = args.sweep or list(QUICK_SWEEP if args.quick else SWEEP)
    samples = args.samples or (1 if args.quick else 3)
    repeats = args.repeats or (2 if args.quick else 7)
    candidates = follow_ups(args.trace)
    model = tiny_llama(seed=args.seed)
    block_bytes = kv_block_bytes(model, TOKENS_PER_BLOCK)
    # Room for every warmed prefix and sweep prompt: no hit may have been evicted.
    tokens = samples * sum(int(t * 1.25) + UNIT for t in targets) + sum(sweep)
    capacity = max(16 << 20, 2 * (tokens // TOKENS_PER_BLOCK + 1) * block_bytes)
    workdir = Path(tempfile.mkdtemp(prefix="kvsbench-ttft-"))
    sidecar = LocalSidecar(workdir, cpu_capacity=f"{capacity}B", tag="ttft")
    client = None
    try:
        sidecar.start()
        client = KVClient.connect(sidecar.endpoint, timeout=10.0)
        lm = CachedLM(model, client, max_tokens=max([*targets, *sweep]) * 2)
        by_length = measure_lengths(lm, candidates, targets, samples, repeats, args.seed)
        by_sweep = measure_sweep(lm, sweep, repeats, args.seed)
    finally:
        if client is not None:
            client.close()
        shutdown = sidecar.close()
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "lengths": by_length,
        "sweep": by_sweep,
        "break_even_tokens": break_even(by_sweep),
        "all_hits_from_cpu": all(
            s["loaded_from_cpu"] == s["loaded_tokens"] == s["expected_tokens"]
            for s in [*by_sweep, *(x for row in by_length for x in row["samples"])]
        ),
        "model": "tiny_llama: 4 layers, hidden 256, 8 heads, 2 KV heads, head_dim 32, fp32",
        "kv_block_bytes": block_bytes,
        "torch_threads": torch.get_num_threads(),
        "scale": SCALE,
        "tokens_per_trace_block": UNIT,
        "min_reuse": MIN_REUSE,
        "follow_ups_in_trace": len(candidates),
        "samples_per_length": samples,
        "repeats": repeats,
        "quick": bool(args.quick),
        "seed": args.seed,
        "sidecar_exit_code": shutdown.exit_code,
        "shm_leftovers": shutdown.leftovers,
        "about": (
            "TTFT (lookup + load + forward to the last token's logits) of a CPU-tier hit "
            "vs a one-shot recompute by the same model, alternated in the same run; "
            f"trace lengths divided by {SCALE}; medians of {repeats} timings"
        ),
    }
    print_report(result)
    if args.json:
        write_json(args.json, result)
    return 0 if shutdown.exit_code == 0 and not shutdown.leftovers else 1


def print_report(r: dict[str, Any]) -> None:
    print(f"follow-ups of the Mooncake conversation trace, lengths / {r['scale']}:")
    print_table(
        ("prompt", "trace tokens", "cached", "cached %", "hit ms", "lookup+load ms",
         "recompute ms", "speedup"),
        [
            [int(x["prompt_tokens"]), int(x["trace_tokens"]), int(x["loaded_tokens"]),
             100 * x["cached_share"], x["hit_ms"], x["hit_lookup_load_ms"], x["recompute_ms"],
             x["speedup"]]
            for x in r["lengths"]
        ],
    )  # fmt: skip
    print("\nprompts cached up to their last token (the best case for a hit):")
    print_table(
        ("prompt", "cached", "hit ms", "lookup+load ms", "recompute ms", "speedup"),
        [
            [x["prompt_tokens"], x["loaded_tokens"], x["hit_ms"],
             x["hit_lookup_ms"] + x["hit_load_ms"], x["recompute_ms"], x["speedup"]]
            for x in r["sweep"]
        ],
    )  # fmt: skip
    be = r["break_even_tokens"]
    print(
        f"\nbreak-even: a hit is faster from {be} tokens on"
        if be is not None
        else "\nbreak-even: no swept length where every longer hit is faster"
    )
    print(
        f"torch threads {r['torch_threads']}; every hit loaded all its cached tokens "
        f"from the CPU tier: {r['all_hits_from_cpu']}; sidecar exit {r['sidecar_exit_code']}, "
        f"{len(r['shm_leftovers'])} shm leftovers"
    )
