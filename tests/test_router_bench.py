"""`kvsidecar bench router` on a tiny slice: it runs, both indexes agree, and
routing by overlap does at least as well as round robin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.router import replay_routed
from cachesim.replay import DEFAULT_TRACE
from cachesim.trace import load_mooncake
from contract.ids import keys_from_ints
from tests.sidecar_proc import ROOT


def test_overlap_routing_beats_round_robin_and_indexes_agree() -> None:
    trace = load_mooncake(DEFAULT_TRACE, tokens_per_block=64, limit=120)
    keys = keys_from_ints(trace.block_ids)
    capacity = trace.num_unique_blocks() // 20
    rr = replay_routed(trace, keys, 4, capacity, 2, None)
    radix = replay_routed(trace, keys, 4, capacity, 2, "radix")
    flat = replay_routed(trace, keys, 4, capacity, 2, "flat")
    assert radix["hit_ratio"] == flat["hit_ratio"] >= rr["hit_ratio"]
    assert radix["events"] == flat["events"] > 0
    assert radix["find_matches_us_p50"] > 0 and radix["dict_floor_us_p50"] > 0
    for run in (radix, flat):  # the busiest worker removed, then swept
        assert run["held_blocks"] >= run["removed_blocks"] > 0
        assert run["remove_worker_ms"] > 0 and run["sweep_total_ms"] >= run["sweep_slice_ms_max"]


def test_bench_router_command_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "kvsidecar", "bench", "router", "--limit", "40"]
    cmd += ["--workers", "2,3", "--tokens-per-block", "128", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "match/dict p50" in proc.stdout and "remove ms" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {f"{n}/{k}" for n in (2, 3) for k in ("round_robin", "radix", "flat")}
