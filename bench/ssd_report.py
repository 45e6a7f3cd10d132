"""`bench ssd`'s figures from its timings, and its tables."""

from __future__ import annotations

import statistics
from typing import Any

from bench.targets import Target, at_least, verdict
from cachesim.report import print_table

TARGET_VS_FLOOR = 0.8


def case_name(n: int, kib: int) -> str:
    return f"{n}x{kib}k"


def paired_ratio(floor: list[float], tier: list[float]) -> float:
    """The tier's rate as a share of the floor's: the median, over the timed
    samples, of floor time / tier time of a sample pair (the k-th of each,
    taken one right after the other). This disk's rate drifts by 10-20%
    over seconds; a pair sees the same moment, so the drift cancels. An A/A
    test (the floor against itself, as this benchmark times it) gave
    0.98-1.03 this way, against 0.90-1.13 for a ratio of the two medians
    when a case had one sample a round (docs/measurements.md#ssd)."""
    if len(floor) != len(tier) or not floor:
        raise ValueError(f"{len(floor)} floor and {len(tier)} tier samples: not pairs")
    return statistics.median(f / t for f, t in zip(floor, tier, strict=True))


def figures(times: dict, pools: dict, cases: list[tuple[int, int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for who, prefix in (("tier", ""), ("floor", "floor_")):
        for phase in ("write", "read"):
            out[f"{prefix}{phase}_gbps"] = {
                kind: {
                    case_name(n, kib): n
                    * (kib << 10)
                    / statistics.median(times[(kind, n, kib, who, phase)])
                    / 1e9
                    for n, kib in cases
                }
                for kind in pools
            }
    out["floor_per_block_write_gbps"] = {
        kind: {
            case_name(n, kib): n
            * (kib << 10)
            / statistics.median(times[(kind, n, kib, "floor_per_block", "write")])
            / 1e9
            for n, kib in cases
        }
        for kind in pools
    }
    out["write_vs_per_block_floor"] = {
        kind: {
            case_name(n, kib): paired_ratio(
                times[(kind, n, kib, "floor_per_block", "write")],
                times[(kind, n, kib, "tier", "write")],
            )
            for n, kib in cases
        }
        for kind in pools
    }
    for phase in ("write", "read"):
        out[f"{phase}_vs_floor"] = {
            kind: {
                case_name(n, kib): paired_ratio(
                    times[(kind, n, kib, "floor", phase)], times[(kind, n, kib, "tier", phase)]
                )
                for n, kib in cases
            }
            for kind in pools
        }
    out["seconds"] = {
        kind: {
            case_name(n, kib): {
                f"{who}_{phase}": times[(kind, n, kib, who, phase)]
                for who in ("tier", "floor")
                for phase in ("write", "read")
            }
            | {"floor_per_block_write": times[(kind, n, kib, "floor_per_block", "write")]}
            for n, kib in cases
        }
        for kind in pools
    }
    if "huge" in pools:
        out["huge_vs_4k"] = {
            f"{who}{phase}": {
                case: out[f"{who}{phase}_gbps"]["huge"][case] / v
                for case, v in out[f"{who}{phase}_gbps"]["4k"].items()
            }
            for who in ("", "floor_")
            for phase in ("write", "read")
        }
    return out


def _mean(values: list) -> float | str:
    known = [v for v in values if v is not None]
    return round(statistics.mean(known), 1) if known else "n/a"


def _note(ratios: dict[str, float]) -> str:
    below = [f"{k} {v:.2f}" for k, v in ratios.items() if v < TARGET_VS_FLOOR]
    return "within target" if not below else "below target: " + ", ".join(below)


def targets(r: dict[str, Any]) -> dict[str, Target]:
    """`write.<pool pages>.<case>`, `read...` and `e2e_get.<case>`: each >=
    TARGET_VS_FLOOR x its floor of the same run."""
    out: dict[str, Target] = {}
    for phase in ("write", "read"):
        rule = f"tier {phase} GB/s / raw O_DIRECT {phase} of the same slots >= {TARGET_VS_FLOOR:g}"
        for kind, by_case in r[f"{phase}_vs_floor"].items():
            for case, ratio in by_case.items():
                out[f"{phase}.{kind}.{case}"] = at_least(ratio, TARGET_VS_FLOOR, rule)
    rule = f"GET through a sidecar / raw O_DIRECT into its CPU-tier slots >= {TARGET_VS_FLOOR:g}"
    for case, e in r["e2e"].items():
        out[f"e2e_get.{case}"] = at_least(e["vs_floor"], TARGET_VS_FLOOR, rule)
    return out


def print_report(r: dict[str, Any]) -> None:
    rows = []
    for kind in r["write_gbps"]:
        for case in r["write_gbps"][kind]:
            w, r_ = r["write_vs_floor"][kind][case], r["read_vs_floor"][kind][case]
            runs = r["pools"][kind]["phys_runs_per_2mib"]
            rows.append((
                case, r["pools"][kind]["page_kind"], "n/a" if runs is None else round(runs, 1),
                r["write_gbps"][kind][case], r["floor_write_gbps"][kind][case], w,
                r["floor_per_block_write_gbps"][kind][case],
                r["write_vs_per_block_floor"][kind][case],
                r["read_gbps"][kind][case], r["floor_read_gbps"][kind][case], r_,
                _note({"write": w, "read": r_}),
            ))  # fmt: skip
    print_table(
        ("case", "pages", "runs/2MiB", "write GB/s", "floor", "ratio", "a write/block",
         "ratio", "read GB/s", "floor", "ratio", f"target >= {TARGET_VS_FLOOR} x floor"),
        rows,
    )  # fmt: skip
    depths = ", ".join(f"{k} {d or 'one (no AIO)'}" for k, d in r["write_depth"].items())
    print(
        "floor: raw O_DIRECT of the same slots, issued as the tier issues them (writes in flight "
        f"a thread: {depths}; reads one at a time); a write/block: raw, one synchronous write "
        "a block (no target)"
    )
    if r["e2e"]:
        print()
        print_table(
            ("GET from SSD", "GB/s", "floor", "ratio", "runs/block", "fresh-pool floor",
             "tier read", "target"),
            [
                (case, e["gbps"], e["floor_read_gbps"], e["vs_floor"],
                 _mean(e["phys_runs_per_block"]), e["table_floor_read_gbps"],
                 e["tier_read_gbps"], _note({"GET": e["vs_floor"]}))
                for case, e in r["e2e"].items()
            ],
        )  # fmt: skip
        print(
            "GET floor: raw O_DIRECT into the sidecar's own CPU-tier slots; runs/block: "
            "physically contiguous runs of pages per block there (root only)"
        )
    huge = r["pools"]["huge"]
    print(
        f"\n{r['threads']} I/O threads, {r['filesystem']} at {r['dir']}, O_DIRECT "
        f"{'on' if r['direct_io'] else 'OFF'}; page cache "
        f"{'dropped' if r['page_cache_dropped'] else 'NOT dropped (not root)'} before reads; "
        f"huge pool: {huge.get('skipped') or huge['how'] + ' -> ' + huge['page_kind']}; "
        f"xxh3 {', '.join(f'{k} {v:.1f}' for k, v in r['checksum_gbps'].items())} GB/s "
        f"on one thread"
    )
    print("fio (psync, one job per thread, its own buffers): " + _fio(r["fio"]))
    print(verdict(r["targets"]))


def _fio(fio: dict[str, dict[str, Any]]) -> str:
    first = next(iter(fio.values()))
    if not first.get("available"):
        return str(first.get("note"))
    return "; ".join(
        f"{case} write {f['write_gbps']:.2f} read {f['read_gbps']:.2f} GB/s"
        if "read_gbps" in f
        else f"{case} failed: {f.get('error', '?')}"
        for case, f in fio.items()
    )
