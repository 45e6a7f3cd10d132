"""The measuring half of `kvsidecar bench ttft`: one sidecar over several
lives on one SSD directory, and the rounds that time an SSD-tier hit, a
CPU-tier hit and a recompute of every prompt, alternately.

Where a hit's blocks come from is made, not hoped for: every cached prefix
is saved once with write-through to SSD; the sidecar is then restarted on
the same directory, so its CPU tier is empty and its SSD index is recovered
from disk. The first hit of a prompt in a life therefore loads from SSD (the
sidecar stages the blocks into the CPU tier), the second from the CPU tier.
Each hit's `loaded_from` (the lookup's split by tier) is checked against
that; a round per life, so every repeat of an SSD hit reads SSD.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.targets import at_most
from bench.ttft_workload import Case
from engine_shim.client import KVClient, TierTokens
from engine_shim.hf import CachedLM, PrefillInfo
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar

# Logits of a hit against the one-shot recompute: K machine epsilons of the
# dtype at the logits' scale (fp32: 32 eps, bf16: 4 eps = 0.03125 at
# |logit| <= 1, the tolerances of tests/test_hf.py; measured on tiny_llama:
# 8.6e-7 and 0.0078).
TOLERANCE_EPS = {torch.float32: 32, torch.bfloat16: 4}
SETTLE_SECONDS = 600.0  # SSD writes of every saved block landing; GBs for an 8B model


class SidecarLives:
    """One sidecar instance (name, runtime and SSD directories) over several
    lives. Each life gets a new KVClient, which `lm` is connected to."""

    def __init__(
        self, workdir: Path, ssd_dir: Path, cpu_bytes: int, ssd_bytes: int, start_timeout: float
    ) -> None:
        settings = {
            **BENCH_SIDECAR_SETTINGS,
            "drain_seconds": 60,
            "ssd_dirs": ssd_dir,
            "ssd_capacity_per_dir": f"{ssd_bytes}B",
            "write_policy": "write_through",
        }
        self.sidecar = LocalSidecar(
            workdir, cpu_capacity=f"{cpu_bytes}B", settings=settings, tag="ttft"
        )
        self.start_timeout = start_timeout
        self.client: KVClient | None = None
        self.exit_codes: list[int | None] = []
        self.leftovers: list[str] = []
        self.restart_s: list[float] = []
        self.recovered: list[dict[str, int]] = []
        """Per restart: blocks in the CPU and SSD tiers as it starts serving."""

    def start(self, lm: CachedLM) -> KVClient:
        self.sidecar.start(self.start_timeout)
        self.client = KVClient.connect(self.sidecar.endpoint, timeout=60.0)
        lm.connect(self.client)
        return self.client

    def settle(self, ssd_blocks: int) -> None:
        """Wait until every write has landed and the SSD tier holds `ssd_blocks`."""
        assert self.client is not None
        start = time.monotonic()
        deadline, shown = start + SETTLE_SECONDS, start
        while True:
            stats = self.client.stats()
            on_ssd = stats["tiers"]["ssd"]["cached_blocks"]
            if stats["plans_in_flight"] == 0 and on_ssd >= ssd_blocks:
                return
            if evicted := stats["tiers"]["ssd"]["evicted_blocks"]:
                raise RuntimeError(
                    f"the SSD tier evicted {evicted} blocks while {ssd_blocks} were written"
                    " through to it: they will never all land"
                )
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"only {on_ssd} of {ssd_blocks} blocks reached the SSD tier")
            if now - shown >= 10:
                shown = now
                print(
                    f"  {on_ssd:,} of {ssd_blocks:,} blocks on the SSD tier"
                    f" after {now - start:.0f} s"
                    f" ({stats['plans_in_flight']} plans in flight,"
                    f" {stats['tiers']['ssd']['ops_in_flight']} SSD ops)",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.05)

    def restart(self, lm: CachedLM) -> KVClient:
        """Stop (SIGTERM) and start again: an empty CPU tier, the SSD index recovered."""
        start = time.perf_counter()
        self.stop(lm)
        client = self.start(lm)
        self.restart_s.append(time.perf_counter() - start)
        tiers = client.stats()["tiers"]
        self.recovered.append({t: tiers[t]["cached_blocks"] for t in ("cpu", "ssd")})
        return client

    def stop(self, lm: CachedLM) -> None:
        lm.connect(None)
        if self.client is not None:
            self.client.close()
            self.client = None
        shutdown = self.sidecar.close(timeout=SETTLE_SECONDS)
        self.exit_codes.append(shutdown.exit_code)
        self.leftovers += shutdown.leftovers


def warm(lives: SidecarLives, lm: CachedLM, cases: list[Case]) -> list[torch.Tensor]:
    """Save every case's prefix (to the CPU tier and through to SSD), take
    first-call costs of every shape out of the timings, and return each
    case's reference logits (`CachedLM.split_recompute` at its prefix)."""
    tpb = lm.tokens_per_block
    refs = []
    start = time.monotonic()
    for i, case in enumerate(cases):
        print(
            f"warm-up {i + 1}/{len(cases)}: {case.ids.size:,} tokens, {case.cached:,} saved"
            f" ({time.monotonic() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        saved = lm.prefill(case.ids[: case.cached]).info.saved_tokens
        if saved != case.cached:
            raise RuntimeError(f"saved {saved} of {case.cached} tokens: is the CPU tier too small?")
        lm.prefill(case.ids, use_sidecar=False)
        refs.append(lm.split_recompute(case.ids, case.cached))
    blocks = sum(c.cached // tpb for c in cases)
    print(f"waiting for {blocks:,} blocks to reach the SSD tier ...", file=sys.stderr, flush=True)
    lives.settle(blocks)
    return refs


@dataclass
class _Timings:
    ssd: list[PrefillInfo]
    cpu: list[PrefillInfo]
    recompute: list[PrefillInfo]
    tolerance: float
    exact: bool = True
    max_abs_diff: float = 0.0
    argmax_equal: bool = True


def measure(
    lives: SidecarLives, lm: CachedLM, cases: list[Case], repeats: int
) -> list[dict[str, Any]]:
    """`repeats` rounds, each in a new sidecar life: per case an SSD hit, then
    a CPU hit, and a recompute first, between them or last in turn (round
    r: position r % 3), so no figure always runs right after the same other.
    One row per case (see `_row`)."""
    refs = warm(lives, lm, cases)
    timings = [_Timings([], [], [], tolerance(ref)) for ref in refs]
    for r in range(repeats):
        print(f"round {r + 1}/{repeats}: restarting the sidecar ...", file=sys.stderr, flush=True)
        lives.restart(lm)
        for case, ref, t in zip(cases, refs, timings, strict=True):
            hits, recompute = [], None
            for step in range(3):
                if step == r % 3:
                    recompute = lm.prefill(case.ids, use_sidecar=False)
                else:  # the first hit of a sidecar life loads from SSD, the next from CPU
                    hits.append(lm.prefill(case.ids, save=False))
            assert recompute is not None
            t.ssd.append(hits[0].info)
            t.cpu.append(hits[1].info)
            t.recompute.append(recompute.info)
            for hit in hits:
                t.exact &= torch.equal(hit.logits, ref)
                t.max_abs_diff = max(t.max_abs_diff, _max_diff(hit.logits, recompute.logits))
                t.argmax_equal &= int(hit.logits.argmax()) == int(recompute.logits.argmax())
    return [_row(c, t) for c, t in zip(cases, timings, strict=True)]


def fidelity(rows: list[dict[str, Any]], tolerance_required: bool) -> dict[str, Any]:
    """Every hit against its references, over all rows. A hit must equal
    split_recompute bit for bit everywhere: that is what the cache promises.
    How far that split computation is from a one-shot recompute is the
    model's own rounding, and the tolerance for it is only required where it
    was calibrated (tiny_llama on the CPU): a 32-layer model on a GPU exceeds
    it with no cache involved (docs/engines.md)."""
    out = {
        "exact_required": True,
        "all_exact": all(r["exact"] for r in rows),
        "max_abs_diff_vs_recompute": max(r["max_abs_diff"] for r in rows),
        "within_tolerance": all(r["max_abs_diff"] <= r["tolerance"] for r in rows),
        "argmax_equal": all(r["argmax_equal"] for r in rows),
        "tolerance_required": tolerance_required,
    }
    near = out["within_tolerance"] and out["argmax_equal"]
    out["ok"] = out["all_exact"] and (near or not tolerance_required)
    return out


def tolerance(logits: torch.Tensor) -> float:
    """What a hit's logits may differ from a one-shot recompute's by."""
    eps = torch.finfo(logits.dtype).eps * TOLERANCE_EPS.get(logits.dtype, 4)
    return float(eps * max(1.0, float(logits.float().abs().max())))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _row(case: Case, t: _Timings) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt_tokens": int(case.ids.size), "cached_tokens": case.cached}
    if case.request is not None:
        row.update(target_tokens=case.target, request=case.request, trace_tokens=case.trace_tokens)
    recompute_ms = _ms(t.recompute)
    row.update(recompute_ms=recompute_ms, recompute_ms_all=_ms_all(t.recompute))
    for tier, infos, want in (
        ("ssd", t.ssd, TierTokens(0, case.cached, 0)),
        ("cpu", t.cpu, TierTokens(case.cached, 0, 0)),
    ):
        hit_ms = _ms(infos)
        row.update(
            {
                f"{tier}_hit_ms": hit_ms,
                f"{tier}_lookup_load_ms": _ms(infos, "lookup_s", "load_s", "build_s"),
                **{f"{tier}_{part}_ms": _ms(infos, f"{part}_s") for part in LOAD_PARTS},
                f"{tier}_compute_ms": _ms(infos, "compute_s"),
                f"{tier}_hit_ms_all": _ms_all(infos),
                f"{tier}_loaded_from": [i.loaded_from._asdict() for i in infos],
                f"{tier}_speedup": recompute_ms / hit_ms,
                f"all_from_{tier}": all(i.loaded_from == want for i in infos),
            }
        )
    row.update(
        exact=t.exact,
        max_abs_diff=t.max_abs_diff,
        tolerance=t.tolerance,
        argmax_equal=t.argmax_equal,
    )
    return row


def _ms(infos: list[PrefillInfo], *parts: str) -> float:
    parts = parts or ("ttft_s",)
    return float(statistics.median(sum(getattr(i, p) for p in parts) for i in infos)) * 1e3


def _ms_all(infos: list[PrefillInfo]) -> list[float]:
    return [i.ttft_s * 1e3 for i in infos]


def summarize(target: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of the rows picked for one target length; a speedup is
    the median of each prompt's own (recompute / hit), never a ratio of
    medians that may come from different prompts."""
    keys = ("prompt_tokens", "trace_tokens", "cached_tokens", "recompute_ms")
    keys += tuple(f"{t}_{k}" for t in ("ssd", "cpu") for k in ("hit_ms", "lookup_load_ms"))
    out: dict[str, Any] = {"target_tokens": target}
    out.update({k: float(statistics.median(r[k] for r in rows)) for k in keys})
    out["cached_share"] = float(
        statistics.median(r["cached_tokens"] / r["prompt_tokens"] for r in rows)
    )
    for tier in ("ssd", "cpu"):
        out[f"{tier}_speedup"] = float(statistics.median(r[f"{tier}_speedup"] for r in rows))
    out["samples"] = rows
    return out


def break_even(sweep: list[dict[str, Any]], tier: str) -> int | None:
    """The shortest swept length from which on every `tier` hit beats the recompute."""
    found = None
    for row in sorted(sweep, key=_prompt_tokens, reverse=True):
        if row[f"{tier}_hit_ms"] >= row["recompute_ms"]:
            break
        found = row["prompt_tokens"]
    return found


def _prompt_tokens(row: dict[str, Any]) -> int:
    return int(row["prompt_tokens"])


LOAD_TARGET_BLOCKS = 32
"""Issue 30's load target: lookup + load of a 32-block cached prefix (512
tokens; 64 MiB for Llama-3-8B) <= LOAD_TARGET_TIMES x the floor's copy of
the same bytes + LOAD_TARGET_SLACK_MS."""
LOAD_TARGET_TIMES, LOAD_TARGET_SLACK_MS = 1.5, 0.3
LOAD_PARTS = ("lookup", "load", "build")
"""A hit's lookup + load, in parts (PrefillInfo): the lookup, the sidecar's
load into the pool, and building the DynamicCache from the pool."""


def copy_floor_ms(nbytes: int, device: str, repeats: int = 20) -> float:
    """The floor of a load of `nbytes`: one copy of that many contiguous
    bytes into the device, from pinned host memory on cuda (a
    cudaMemcpyAsync, waited for), host to host on the CPU; the median of
    `repeats` after two untimed ones, in ms."""
    cuda = device == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 2):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def load_target(
    sweep: list[dict[str, Any]], block_bytes: int, device: str, tokens_per_block: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the floor measured now, the target) for the sweep row whose cached
    prefix is LOAD_TARGET_BLOCKS blocks; value None when the sweep has none."""
    nbytes = LOAD_TARGET_BLOCKS * block_bytes
    floor = {
        "blocks": LOAD_TARGET_BLOCKS,
        "bytes": nbytes,
        "copy_ms": copy_floor_ms(nbytes, device),
        "copy": "pinned host -> GPU, one cudaMemcpyAsync" if device == "cuda" else "host memcpy",
    }
    cached = LOAD_TARGET_BLOCKS * tokens_per_block
    row = next((r for r in sweep if r["cached_tokens"] == cached), None)
    limit = LOAD_TARGET_TIMES * floor["copy_ms"] + LOAD_TARGET_SLACK_MS
    rule = (
        f"CPU-tier lookup + load of a {LOAD_TARGET_BLOCKS}-block prefix, ms, <= "
        f"{LOAD_TARGET_TIMES:g} x the floor's copy of its bytes + {LOAD_TARGET_SLACK_MS:g} "
        "(issue 30: Llama-3-8B on a GPU)"
    )
    target = at_most(None if row is None else row["cpu_lookup_load_ms"], limit, rule)
    if row is not None:
        target["parts_ms"] = {part: row[f"cpu_{part}_ms"] for part in LOAD_PARTS}
    return floor, target
