"""`kvsidecar bench ttft`: time to first token with an SSD-tier hit and a
CPU-tier hit against a full recompute (engine_shim.hf.CachedLM), all three
measured in the same run.

Models. `--model small` (default): a 4-layer random-weight Llama, fp32 on the
CPU. `--model llama3-8b`: random weights with Llama-3-8B's geometry (32
layers, hidden 4096, 32 heads, 8 KV heads, head dim 128), built on
`--device` in `--dtype` (default bf16), nothing downloaded; meant for
`--device cuda`, where the engine's paged KV lives in GPU memory and
cuda_ext's copier moves blocks between it and the sidecar's shm.

Workload. The Mooncake conversation trace's follow-ups (requests that share
at least half of their 512-token hash blocks with an earlier request: later
turns of a conversation) give prompt lengths and the share of each prompt an
earlier turn left in the cache. Lengths are divided by `--scale` (default 8
for the small model on a CPU: a 512-token trace block becomes 64 tokens, a
16k-token prompt 2k; 1 for llama3-8b). Each hash id names 512/scale token
ids drawn from a generator seeded by the id and the prompt's index, so a
follow-up shares tokens with its own earlier turn and with no other prompt
of the run. For each target length, follow-ups within 0.8-1.25x of it are
taken; the prefix they share with the earlier request is prefilled and saved.

Tiers. The sidecar has a CPU tier and an SSD tier (`--ssd-dir`, default a
temporary directory under /tmp) with write-through: every saved block also
goes to SSD. Then the sidecar is restarted on the same directory for each
round: its CPU tier is empty and its SSD index is recovered from disk. In a
round, each prompt's first hit loads from SSD (staged into the CPU tier by
the sidecar), its second from the CPU tier, then it is recomputed. Every
hit's per-tier load counts are checked (`all_from_ssd`, `all_from_cpu`).

Timing. TTFT = lookup + load + forward until the last token's logits; the
save after it is not on the first token's path (hits run with save=False).
The floor is a one-shot recompute by the same model, alternated with the
hits. Medians of --repeats rounds; speedup = recompute / hit.

Fidelity. Every hit's logits are compared with `split_recompute` (the
forwards the hit's inputs came from, without the cache): bit-identical
required on the CPU; and with the one-shot recompute: within 32 fp32 eps or
4 bf16 eps at the logits' scale, argmax equal.

Break-even. Prompts of growing length (whole blocks and one token) whose
every full block is cached: the break-even length of a tier is the shortest
swept length from which on every hit from it is faster than the recompute.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import positive_int_list, write_json
from bench.trace import MOONCAKE_BLOCK_TOKENS, load_mooncake

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl"
MIN_REUSE = 0.5  # a follow-up shares at least this share of its hash ids
# Whole blocks plus one token: a hit loads every block and computes one token.
SWEEP = (17, 33, 49, 65, 97, 129, 193, 257, 385, 513)
QUICK_SWEEP = (17, 33, 65, 129)
TOKENS_PER_BLOCK = 16
DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class ModelChoice:
    scale: int
    """Trace lengths are divided by this."""
    targets: tuple[int, ...]
    """Prompt lengths after scaling."""
    dtype: str
    about: str


MODELS = {
    "small": ModelChoice(
        8,
        (256, 512, 1024, 2048, 4096),
        "fp32",
        "tiny_llama: 4 layers, hidden 256, 8 heads, 2 KV heads, head_dim 32",
    ),
    "llama3-8b": ModelChoice(
        1,
        (1024, 2048, 4096, 8192, 16384),
        "bf16",
        "llama3_8b: Llama-3-8B geometry, random weights: 32 layers, hidden 4096, "
        "32 heads, 8 KV heads, head_dim 128, intermediate 14336, vocab 128256",
    ),
}
QUICK_TARGETS = (256, 1024)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ttft",
        help="time to first token: SSD-tier and CPU-tier hits vs full recompute (HF Llama)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--model", choices=tuple(MODELS), default="small", help="default small")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    p.add_argument(
        "--dtype", choices=DTYPES, default=None, help="default fp32 (small), bf16 (llama3-8b)"
    )
    p.add_argument(
        "--ssd-dir",
        type=Path,
        default=None,
        help="where the SSD tier's files go (a temporary directory is made in it and "
        "removed; default under /tmp)",
    )
    p.add_argument(
        "--scale",
        type=int,
        default=None,
        help="divide trace lengths by this (default 8 for small, 1 for llama3-8b)",
    )
    p.add_argument(
        "--lengths",
        type=positive_int_list,
        default=None,
        help="target prompt lengths after scaling (default small: "
        + ",".join(map(str, MODELS["small"].targets))
        + "; llama3-8b: "
        + ",".join(map(str, MODELS["llama3-8b"].targets))
        + ")",
    )
    p.add_argument(
        "--sweep",
        type=positive_int_list,
        default=None,
        help="break-even sweep lengths (default " + ",".join(map(str, SWEEP)) + ")",
    )
    p.add_argument("--samples", type=int, default=None, help="follow-ups per length (default 3)")
    p.add_argument(
        "--repeats", type=int, default=None, help="rounds, one sidecar restart each (default 7)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    p.add_argument("--quick", action="store_true", help="few small cases, for the test suite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


# ---- workload ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One prompt and the prefix of it an earlier prompt saved."""

    ids: np.ndarray
    cached: int
    """Leading tokens saved before (full blocks, short of the last token):
    what a hit must load."""
    target: int | None = None
    """The length it was picked for; None in the break-even sweep."""
    request: int | None = None
    """Its index in the trace; None in the break-even sweep."""
    trace_tokens: int | None = None


@dataclass(frozen=True)
class FollowUp:
    request: int
    """Its index in the trace."""
    trace_tokens: int
    hash_ids: np.ndarray
    shared_ids: int
    """Leading hash ids an earlier request had."""
    scale: int

    @property
    def unit(self) -> int:
        """Tokens per trace hash id after scaling."""
        return MOONCAKE_BLOCK_TOKENS // self.scale

    @property
    def tokens(self) -> int:
        """Prompt length after scaling."""
        return min(-(-self.trace_tokens // self.scale), self.hash_ids.size * self.unit)

    @property
    def cacheable(self) -> int:
        """Leading tokens an earlier turn cached: the shared ids' tokens, full blocks only."""
        shared = min(self.shared_ids * self.unit, self.tokens - 1)
        return shared // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK


def follow_ups(path: Path, scale: int) -> list[FollowUp]:
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
            out.append(FollowUp(r, int(trace.input_lengths[r]), ids, shared, scale))
        seen.update(int(h) for h in ids)
    return out


def pick(candidates: list[FollowUp], target: int, k: int, seed: int) -> list[FollowUp]:
    """Up to k follow-ups whose scaled length is within 0.8-1.25x of `target`."""
    near = [f for f in candidates if 0.8 * target <= f.tokens <= 1.25 * target and f.cacheable]
    return sorted(random.Random(seed + target).sample(near, min(k, len(near))), key=_request)


def _request(f: FollowUp) -> int:
    return f.request


def prompt_tokens(f: FollowUp, vocab: int, salt: int = 0) -> np.ndarray:
    """`f.tokens` token ids: `f.unit` ids per hash id, drawn from a generator
    seeded by (salt, id): prompts of one salt that share hash ids share tokens."""
    parts = [np.random.default_rng((salt, int(h))).integers(0, vocab, f.unit) for h in f.hash_ids]
    return np.concatenate(parts)[: f.tokens]


def trace_cases(
    candidates: list[FollowUp], targets: list[int], k: int, seed: int, vocab: int
) -> list[Case]:
    """Up to k follow-ups per target length, each with tokens of its own."""
    cases: list[Case] = []
    for target in targets:
        chosen = pick(candidates, target, k, seed)
        if not chosen:
            print(f"no follow-up of ~{target} tokens in the trace", file=sys.stderr)
        for f in chosen:
            ids = prompt_tokens(f, vocab, salt=len(cases))
            cases.append(Case(ids, f.cacheable, target, f.request, f.trace_tokens))
    return cases


def sweep_cases(lengths: list[int], seed: int, vocab: int) -> list[Case]:
    """Random prompts whose every full block short of the last token is cached."""
    rng = np.random.default_rng((seed, 1))
    return [
        Case(rng.integers(0, vocab, n), (n - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK)
        for n in lengths
        if n > TOKENS_PER_BLOCK
    ]


# ---- command -------------------------------------------------------------------


class BadArguments(ValueError):
    """A flag the run cannot go ahead with; the message says what to change."""


def check_args(args: argparse.Namespace, cuda_available: bool) -> None:
    if args.device == "cuda" and not cuda_available:
        raise BadArguments(
            "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is "
            "False); run on a GPU machine or use --device cpu"
        )
    for flag in ("scale", "samples", "repeats", "threads"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise BadArguments(f"--{flag} must be a positive integer, got {value}")
    scale = args.scale or MODELS[args.model].scale
    if MOONCAKE_BLOCK_TOKENS % scale or (MOONCAKE_BLOCK_TOKENS // scale) % TOKENS_PER_BLOCK:
        raise BadArguments(
            f"--scale must leave whole {TOKENS_PER_BLOCK}-token blocks per 512-token trace "
            f"block (1, 2, 4, 8, 16 or 32), got {scale}"
        )
    if args.ssd_dir is not None and not args.ssd_dir.is_dir():
        raise BadArguments(f"--ssd-dir {args.ssd_dir}: not an existing directory")
    if args.sweep is not None and max(args.sweep) <= TOKENS_PER_BLOCK:
        raise BadArguments(f"--sweep needs lengths above {TOKENS_PER_BLOCK} (one whole block)")


def build_model(args: argparse.Namespace, dtype: Any) -> Any:
    from engine_shim.hf import llama3_8b, tiny_llama

    if args.model == "llama3-8b":
        if args.device == "cpu":
            print("building llama3-8b on the CPU: ~16 GB in bf16, minutes", file=sys.stderr)
        return llama3_8b(args.seed, dtype=dtype, device=args.device)
    return tiny_llama(args.seed, dtype=dtype).to(args.device)


def run(args: argparse.Namespace) -> int:
    try:
        import torch

        from bench.ttft_measure import (
            SidecarLives,
            break_even,
            fidelity,
            measure,
            summarize,
        )
        from engine_shim.hf import CachedLM, kv_block_bytes
    except ImportError:
        print("bench ttft needs torch and transformers: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    from bench.ssd import filesystem_of
    from bench.ttft_report import print_report

    try:
        check_args(args, torch.cuda.is_available())
    except BadArguments as err:
        print(f"bench ttft: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    choice = MODELS[args.model]
    dtype_name = args.dtype or choice.dtype
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    scale = args.scale or choice.scale
    targets = args.lengths or list(QUICK_TARGETS if args.quick else choice.targets)
    samples = args.samples or (1 if args.quick else 3)
    repeats = args.repeats or (2 if args.quick else 7)
    candidates = follow_ups(args.trace, scale)
    model = build_model(args, dtype)
    vocab = model.config.vocab_size
    cases = trace_cases(candidates, targets, samples, args.seed, vocab)
    sweep = sweep_cases(args.sweep or list(QUICK_SWEEP if args.quick else SWEEP), args.seed, vocab)
    block_bytes = kv_block_bytes(model, TOKENS_PER_BLOCK)
    # Every saved prefix fits in either tier (nothing is evicted), with room
    # for the eviction threshold.
    blocks = sum(c.cached // TOKENS_PER_BLOCK for c in [*cases, *sweep])
    cpu_bytes = max(16 << 20, (blocks * 5 // 4 + 64) * block_bytes)
    workdir = Path(tempfile.mkdtemp(prefix="kvsbench-ttft-"))
    ssd_dir = Path(tempfile.mkdtemp(prefix="kvsbench-ttft-ssd-", dir=args.ssd_dir))
    max_tokens = -(-max(c.ids.size for c in [*cases, *sweep]) // TOKENS_PER_BLOCK + 1)
    lm = CachedLM(
        model,
        None,
        model_name=f"bench-ttft-{args.model}",
        model_revision=f"random-seed{args.seed}-{args.device}",
        max_tokens=max_tokens * TOKENS_PER_BLOCK,
    )
    lives = SidecarLives(workdir, ssd_dir, cpu_bytes, cpu_bytes * 5 // 4, start_timeout=600.0)
    try:
        lives.start(lm)
        print(f"{len(cases)} trace prompts, {len(sweep)} sweep prompts ...", file=sys.stderr)
        rows = measure(lives, lm, [*cases, *sweep], repeats)
        ssd_stats = lives.client.stats()["tiers"]["ssd"] if lives.client else {}
        filesystem = filesystem_of(ssd_dir)
    finally:
        lives.stop(lm)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(ssd_dir, ignore_errors=True)
    trace_rows, sweep_rows = rows[: len(cases)], rows[len(cases) :]
    by_length = [
        summarize(t, [r for r in trace_rows if r["target_tokens"] == t])
        for t in targets
        if any(r["target_tokens"] == t for r in trace_rows)
    ]
    checks = fidelity(rows, exact_required=args.device == "cpu")
    result: dict[str, Any] = {
        "lengths": by_length,
        "sweep": sweep_rows,
        "break_even_tokens": {t: break_even(sweep_rows, t) for t in ("cpu", "ssd")},
        "all_from_cpu": all(r["all_from_cpu"] for r in rows),
        "all_from_ssd": all(r["all_from_ssd"] for r in rows),
        "fidelity": checks,
        "model": args.model,
        "model_about": choice.about,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": dtype_name,
        "kv_block_bytes": block_bytes,
        "kv_pool_device": str(lm.pool.device),
        "cpu_tier_bytes": cpu_bytes,
        "ssd": {
            "filesystem": filesystem,
            "direct_io": ssd_stats.get("direct_io"),
            "saved_blocks": blocks,
            "restarts": len(lives.restart_s),
            "restart_s": lives.restart_s,
            "blocks_at_restart": lives.recovered,
        },
        "torch_threads": torch.get_num_threads(),
        "scale": scale,
        "tokens_per_trace_block": MOONCAKE_BLOCK_TOKENS // scale,
        "min_reuse": MIN_REUSE,
        "follow_ups_in_trace": len(candidates),
        "samples_per_length": samples,
        "repeats": repeats,
        "quick": bool(args.quick),
        "seed": args.seed,
        "sidecar_exit_codes": lives.exit_codes,
        "shm_leftovers": lives.leftovers,
        "about": (
            "TTFT (lookup + load + forward to the last token's logits) of an SSD-tier hit "
            "(after a sidecar restart: CPU tier empty, SSD index recovered) and a CPU-tier "
            "hit vs a one-shot recompute by the same model, alternated in the same run; "
            f"trace lengths divided by {scale}; medians of {repeats} rounds"
        ),
    }
    print_report(result)
    if args.json:
        write_json(args.json, result)
    clean = all(code == 0 for code in lives.exit_codes) and not lives.leftovers
    verified = result["all_from_cpu"] and result["all_from_ssd"] and checks["ok"]
    return 0 if clean and verified else 1
