r"""`kvsidecar bench ttft`: time to first token with an SSD-tier hit and a
CPU-tier hit against a full recompute (engine_shim.hf.CachedLM), all three
measured in the same run.

Models. `--model small` (default): a 4-layer random-weight Llama, fp32 on the
CPU (or `--device cuda`, `--dtype bf16`). `--model llama3-8b`: random
weights with Llama-3-8B's geometry (32 layers, hidden 4096, 32 heads, 8 KV
heads, head dim 128), built straight on `--device` (default cuda; the CPU
only when asked with --device cpu) in `--dtype` (default bf16), nothing
downloaded. On cuda the engine's paged KV lives in GPU memory and cuda_ext's
copier moves blocks between it and the sidecar's shm.

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
the sidecar), its second from the CPU tier, and it is recomputed first,
between the hits or last, in turn from round to round. Every
hit's per-tier load counts are checked (`all_from_ssd`, `all_from_cpu`).

Timing. TTFT = lookup + load + forward until the last token's logits; the
save after it is not on the first token's path (hits run with save=False).
The floor is a one-shot recompute by the same model, alternated with the
hits. Medians of --repeats rounds; speedup = recompute / hit, for a length
row the median of its prompts' own speedups.

Fidelity. Every hit's logits are compared with `split_recompute` (the
forwards the hit's inputs came from, without the cache): bit-identical
required; and with the one-shot recompute: within 32 fp32 eps or 4 bf16 eps
at the logits' scale, argmax equal, required on the CPU and reported on a
GPU (where a 32-layer model's split and one-shot forwards differ by more,
cache or no cache).

Break-even. Prompts of growing length (whole blocks and one token) whose
every full block is cached: the break-even length of a tier is the shortest
swept length from which on every hit from it is faster than the recompute.

On a GPU machine (16 GB of weights on the GPU; for the default lengths a
14 GiB CPU tier and 17.5 GiB of SSD files):
  kvsidecar bench ttft --device cuda --dtype bf16 --model llama3-8b \
      --json bench/results/ttft_<gpu>.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.ttft_workload import (
    MIN_REUSE,
    TOKENS_PER_BLOCK,
    Case,
    follow_ups,
    sweep_cases,
    trace_cases,
)
from cachesim.replay import DEFAULT_TRACE
from cachesim.report import positive_int_list, write_json
from cachesim.trace import MOONCAKE_BLOCK_TOKENS

# Whole blocks plus one token: a hit loads every block and computes one token.
SWEEP = (17, 33, 49, 65, 97, 129, 193, 257, 385, 513)
QUICK_SWEEP = (17, 33, 65, 129)
DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class ModelChoice:
    scale: int
    """Trace lengths are divided by this."""
    targets: tuple[int, ...]
    """Prompt lengths after scaling."""
    device: str
    dtype: str
    about: str


MODELS = {
    "small": ModelChoice(
        8,
        (256, 512, 1024, 2048, 4096),
        "cpu",
        "fp32",
        "tiny_llama: 4 layers, hidden 256, 8 heads, 2 KV heads, head_dim 32",
    ),
    "llama3-8b": ModelChoice(
        1,
        (1024, 2048, 4096, 8192, 16384),
        "cuda",
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
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default cpu (small), cuda (llama3-8b: building it on the CPU takes 16 GB)",
    )
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


# ---- command -------------------------------------------------------------------


class BadArguments(ValueError):
    """A flag the run cannot go ahead with; the message says what to change."""


def check_args(args: argparse.Namespace, cuda_available: bool) -> None:
    if (args.device or MODELS[args.model].device) == "cuda" and not cuda_available:
        raise BadArguments(
            f"--model {args.model} --device cuda: torch sees no CUDA device here "
            "(torch.cuda.is_available() is False); run on a GPU machine or pass --device cpu"
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


def build_model(args: argparse.Namespace, device: str, dtype: Any) -> Any:
    from engine_shim.hf import llama3_8b, tiny_llama

    if args.model == "llama3-8b":
        if device == "cpu":
            print("building llama3-8b on the CPU: ~16 GB in bf16, minutes", file=sys.stderr)
        return llama3_8b(args.seed, dtype=dtype, device=device)
    return tiny_llama(args.seed, dtype=dtype).to(device)


@dataclass(frozen=True)
class Settings:
    """The flags with every default resolved."""

    device: str
    dtype: str
    scale: int
    targets: list[int]
    sweep: list[int]
    samples: int
    repeats: int


def settings_of(args: argparse.Namespace) -> Settings:
    choice = MODELS[args.model]
    return Settings(
        device=args.device or choice.device,
        dtype=args.dtype or choice.dtype,
        scale=args.scale or choice.scale,
        targets=args.lengths or list(QUICK_TARGETS if args.quick else choice.targets),
        sweep=args.sweep or list(QUICK_SWEEP if args.quick else SWEEP),
        samples=args.samples or (1 if args.quick else 3),
        repeats=args.repeats or (2 if args.quick else 7),
    )


def run(args: argparse.Namespace) -> int:
    try:
        import torch

        from bench.ttft_measure import break_even, fidelity, load_target, summarize
        from engine_shim.hf import kv_block_bytes
    except ImportError:
        print("bench ttft needs torch and transformers: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    from bench.ttft_report import print_report

    try:
        check_args(args, torch.cuda.is_available())
    except BadArguments as err:
        print(f"bench ttft: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    s = settings_of(args)
    candidates = follow_ups(args.trace, s.scale)
    model = build_model(args, s.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[s.dtype])
    vocab = model.config.vocab_size
    cases = trace_cases(candidates, s.targets, s.samples, args.seed, vocab)
    sweep = sweep_cases(s.sweep, args.seed, vocab)
    rows, sidecar = measure_in_sidecar(args, s, model, [*cases, *sweep])
    trace_rows, sweep_rows = rows[: len(cases)], rows[len(cases) :]
    by_length = [
        summarize(t, [r for r in trace_rows if r["target_tokens"] == t])
        for t in s.targets
        if any(r["target_tokens"] == t for r in trace_rows)
    ]
    checks = fidelity(rows, tolerance_required=s.device == "cpu")
    block_bytes = kv_block_bytes(model, TOKENS_PER_BLOCK)
    floor, target = load_target(sweep_rows, block_bytes, s.device, TOKENS_PER_BLOCK)
    result: dict[str, Any] = {
        "lengths": by_length,
        "sweep": sweep_rows,
        "break_even_tokens": {t: break_even(sweep_rows, t) for t in ("cpu", "ssd")},
        "all_from_cpu": all(r["all_from_cpu"] for r in rows),
        "all_from_ssd": all(r["all_from_ssd"] for r in rows),
        "fidelity": checks,
        "load_floor": floor,
        "targets": {"lookup_load_32_blocks_ms": target},
        "model": args.model,
        "model_about": MODELS[args.model].about,
        "device": s.device,
        "device_name": torch.cuda.get_device_name() if s.device == "cuda" else "cpu",
        "dtype": s.dtype,
        **sidecar,
        "torch_threads": torch.get_num_threads(),
        "scale": s.scale,
        "tokens_per_trace_block": MOONCAKE_BLOCK_TOKENS // s.scale,
        "min_reuse": MIN_REUSE,
        "follow_ups_in_trace": len(candidates),
        "samples_per_length": s.samples,
        "repeats": s.repeats,
        "quick": bool(args.quick),
        "seed": args.seed,
        "about": (
            "TTFT (lookup + load + forward to the last token's logits) of an SSD-tier hit "
            "(after a sidecar restart: CPU tier empty, SSD index recovered) and a CPU-tier "
            "hit vs a one-shot recompute by the same model, alternated in the same run; "
            f"trace lengths divided by {s.scale}; medians of {s.repeats} rounds"
        ),
    }
    print_report(result)
    if args.json:
        write_json(args.json, result)
    clean = all(c == 0 for c in result["sidecar_exit_codes"]) and not result["shm_leftovers"]
    verified = result["all_from_cpu"] and result["all_from_ssd"] and checks["ok"]
    return 0 if clean and verified else 1


def measure_in_sidecar(
    args: argparse.Namespace, s: Settings, model: Any, cases: list[Case]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of `bench.ttft_measure.measure`, and what the run's sidecar and
    pool were: a private sidecar whose tiers both hold every saved prefix
    (with room below the eviction threshold), its SSD files in a temporary
    directory under --ssd-dir; all removed afterwards."""
    from bench.ssd import filesystem_of
    from bench.ttft_measure import SidecarLives, measure
    from engine_shim.hf import CachedLM, kv_block_bytes

    block_bytes = kv_block_bytes(model, TOKENS_PER_BLOCK)
    blocks = sum(c.cached // TOKENS_PER_BLOCK for c in cases)
    cpu_bytes = max(16 << 20, (blocks * 5 // 4 + 64) * block_bytes)
    max_blocks = max(c.ids.size for c in cases) // TOKENS_PER_BLOCK + 1
    lm = CachedLM(
        model,
        None,
        model_name=f"bench-ttft-{args.model}",
        model_revision=f"random-seed{args.seed}-{s.device}",
        max_tokens=max_blocks * TOKENS_PER_BLOCK,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvsbench-ttft-"))
    ssd_dir = Path(tempfile.mkdtemp(prefix="kvsbench-ttft-ssd-", dir=args.ssd_dir))
    lives = SidecarLives(workdir, ssd_dir, cpu_bytes, cpu_bytes * 5 // 4, start_timeout=600.0)
    try:
        lives.start(lm)
        print(f"{len(cases)} prompts ...", file=sys.stderr, flush=True)
        rows = measure(lives, lm, cases, s.repeats)
        assert lives.client is not None
        direct_io = lives.client.stats()["tiers"]["ssd"]["direct_io"]
        filesystem = filesystem_of(ssd_dir)
    finally:
        lives.stop(lm)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(ssd_dir, ignore_errors=True)
    return rows, {
        "kv_block_bytes": block_bytes,
        "kv_pool_device": str(lm.pool.device),
        "cpu_tier_bytes": cpu_bytes,
        "ssd": {
            "filesystem": filesystem,
            "direct_io": direct_io,
            "saved_blocks": blocks,
            "restarts": len(lives.restart_s),
            "restart_s": lives.restart_s,
            "blocks_at_restart": lives.recovered,
        },
        "sidecar_exit_codes": lives.exit_codes,
        "shm_leftovers": lives.leftovers,
    }
