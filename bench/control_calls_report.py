"""The per-call tables of `kvsidecar bench control` (bench/control_calls.py)."""

from __future__ import annotations

from typing import Any

from cachesim.report import print_table

SYSTEMS = ("memcpy", "kvsidecar", "aibrix", "lmcache")


def print_calls(c: dict[str, Any]) -> None:
    rows, vs = c["rows_us"], c["vs"]
    shown = [s for s in SYSTEMS if s in rows]
    headers = (
        "per call (p50 us)",
        *shown,
        *(f"kvs / {s}" if s != "memcpy" else "x memcpy speed" for s in shown if s != "kvsidecar"),
        "target",
    )
    table = []
    for row in rows["kvsidecar"]:
        cells = [rows[s].get(row, {}).get("p50", "-") for s in shown]
        ratios = [vs[row].get(s, "-") for s in shown if s != "kvsidecar"]
        table.append((row, *cells, *ratios, _targets_of(c["targets"], row)))
    print_table(headers, table)
    rates = c["lookup_rates_rps"]
    print()
    print_table(
        ("lookup rate, 64 blocks", "raw ping-pong /s", "KVClient.lookup /s", "x raw", "target"),
        [
            (
                f"{n} clients",
                v["raw"],
                v["lookup"],
                v["lookup_vs_raw"],
                _targets_of(c["targets"], "lookup_rate_4_clients") if n == "4" else "",
            )
            for n, v in rates.items()
        ],
    )
    for name, system in c["systems"].items():
        if system["error"]:
            print(f"\n{name}: no rows: {system['error']}")


def _targets_of(targets: dict[str, dict[str, Any]], row: str) -> str:
    parts = []
    for name, t in targets.items():
        if not name.startswith(f"calls.{row}.") and name != f"calls.{row}_vs_raw":
            continue
        what = name.rsplit(".", 1)[1].removeprefix("vs_")
        if t["within"] is None:
            parts.append(f"{what}: not measured")
        else:
            parts.append(f"{what}: {'ok' if t['within'] else 'OVER'}")
    return "; ".join(parts)
