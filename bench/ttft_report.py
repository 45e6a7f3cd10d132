"""The tables `kvsidecar bench ttft` prints from its JSON result."""

from __future__ import annotations

from typing import Any

from bench.targets import verdict
from cachesim.report import print_table


def print_report(r: dict[str, Any]) -> None:
    print(
        f"{r['model']} ({r['dtype']}, {r['device_name']}); follow-ups of the Mooncake "
        f"conversation trace, lengths / {r['scale']}, each prompt on its own row:"
    )
    print_table(
        ("length", "prompt", "trace tokens", "cached", "cached %", "recompute ms", "cpu hit ms",
         "cpu speedup", "ssd hit ms", "ssd speedup", "cpu / ssd lookup+load ms"),
        [
            [x["target_tokens"], s["prompt_tokens"], s["trace_tokens"], s["cached_tokens"],
             100 * s["cached_tokens"] / s["prompt_tokens"], s["recompute_ms"], s["cpu_hit_ms"],
             s["cpu_speedup"], s["ssd_hit_ms"], s["ssd_speedup"], _pair(s)]
            for x in r["lengths"] for s in x["samples"]
        ],
    )  # fmt: skip
    print("median speedup of each length's prompts (cpu / ssd): " + ", ".join(
        f"{x['target_tokens']}: {x['cpu_speedup']:.3g} / {x['ssd_speedup']:.3g}"
        for x in r["lengths"]
    ))  # fmt: skip
    print("\nprompts cached up to their last token (the best case for a hit):")
    print_table(
        ("prompt", "cached", "recompute ms", "cpu hit ms", "cpu speedup", "ssd hit ms",
         "ssd speedup", "cpu / ssd lookup+load ms"),
        [
            [x["prompt_tokens"], x["cached_tokens"], x["recompute_ms"], x["cpu_hit_ms"],
             x["cpu_speedup"], x["ssd_hit_ms"], x["ssd_speedup"], _pair(x)]
            for x in r["sweep"]
        ],
    )  # fmt: skip
    print()
    for tier, be in r["break_even_tokens"].items():
        print(
            f"break-even ({tier} hit): faster from {be} tokens on"
            if be is not None
            else f"break-even ({tier} hit): no swept length where every longer hit is faster"
        )
    f, ssd = r["fidelity"], r["ssd"]
    print(
        f"every hit loaded all its cached tokens from its tier: cpu {r['all_from_cpu']}, "
        f"ssd {r['all_from_ssd']} ({ssd['filesystem']}, O_DIRECT {ssd['direct_io']}, "
        f"{ssd['restarts']} restarts)"
    )
    print(
        f"fidelity: bit-identical to split_recompute {f['all_exact']} "
        f"(required: {f['exact_required']}); max |diff| vs the one-shot recompute "
        f"{f['max_abs_diff_vs_recompute']:.3g} (within tolerance: {f['within_tolerance']}); "
        f"argmax equal {f['argmax_equal']} (both required: {f['tolerance_required']})"
    )
    print(
        f"torch threads {r['torch_threads']}; sidecar exits {r['sidecar_exit_codes']}, "
        f"{len(r['shm_leftovers'])} shm leftovers"
    )
    fl = r["load_floor"]
    print(
        f"load floor: {fl['blocks']} blocks, {fl['bytes'] / 2**20:.3g} MiB, {fl['copy']}: "
        f"{fl['copy_ms']:.3g} ms"
    )
    parts = r["targets"]["lookup_load_32_blocks_ms"].get("parts_ms")
    if parts:
        shown = ", ".join(f"{name} {ms:.3g}" for name, ms in parts.items())
        print(f"its CPU hit's lookup + load in parts, ms: {shown} (build: the DynamicCache)")
    print(verdict(r["targets"]))


def _pair(row: dict[str, Any]) -> str:
    return f"{row['cpu_lookup_load_ms']:.3g} / {row['ssd_lookup_load_ms']:.3g}"
