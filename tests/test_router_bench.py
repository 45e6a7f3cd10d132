"""`kvsidecar bench router` on a tiny slice: it runs, both indexes agree, and
routing by overlap does at least as well as round robin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.router import INDEXES, replay_routed
from bench.router_dynamo import DEEP_BLOCKS, IMPLS, _targets, compare, record
from bench.router_peer import measure
from cachesim.replay import DEFAULT_TRACE
from cachesim.trace import load_mooncake
from contract.ids import keys_from_ints
from sideenv import python_of
from sideenv.specs import DYNAMO
from tests.sidecar_proc import ROOT


def test_overlap_routing_beats_round_robin_and_indexes_agree() -> None:
    trace = load_mooncake(DEFAULT_TRACE, tokens_per_block=64, limit=120)
    keys = keys_from_ints(trace.block_ids)
    capacity = trace.num_unique_blocks() // 20
    rr = replay_routed(trace, keys, 4, capacity, 2, None)
    runs = [replay_routed(trace, keys, 4, capacity, 2, index) for index in INDEXES]
    assert len({run["hit_ratio"] for run in runs}) == 1 and runs[0]["hit_ratio"] >= rr["hit_ratio"]
    assert len({run["events"] for run in runs}) == 1 and runs[0]["events"] > 0
    assert runs[0]["find_matches_us_p50"] > 0 and runs[0]["dict_floor_us_p50"] > 0
    for run in runs:  # the busiest worker removed, then swept
        assert run["held_blocks"] >= run["removed_blocks"] > 0
        assert run["remove_worker_ms"] > 0 and run["sweep_total_ms"] >= run["sweep_slice_ms_max"]


def test_bench_router_command_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "kvsidecar", "bench", "router", "--limit", "40"]
    cmd += ["--workers", "2,3", "--tokens-per-block", "128", "--json", str(out), "--no-peers"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "match/dict p50" in proc.stdout and "remove ms" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {f"{n}/{k}" for n in (2, 3) for k in ("round_robin", *INDEXES)}


def _stream(requests: int = 60) -> dict:
    trace = load_mooncake(DEFAULT_TRACE, tokens_per_block=16, limit=requests)
    capacity = trace.num_unique_blocks() // 20
    return record(trace, keys_from_ints(trace.block_ids), 8, capacity, 2, requests)


def test_our_indexes_replay_a_recorded_stream_alike() -> None:
    """The side by side's harness on our three indexes: same scores, every
    figure measured, the held blocks as recorded."""
    stream = _stream()
    assert stream["held_blocks"] > 0 and stream["classes"]["full"] == 60
    runs = [measure(index, stream) for index in INDEXES]
    assert all(run["scores"] == runs[0]["scores"] for run in runs)
    assert len(runs[0]["scores"]) == len(stream["queries"])
    assert any(max((s for _, s in row), default=0) >= DEEP_BLOCKS for row in runs[0]["scores"])
    for run in runs:
        assert run["ingest_event_max_cpu_ms"] > 0
        assert run["ingest_blocks_per_s"] > 0 and run["remove_total_ms"] > 0


@pytest.mark.skipif(python_of(DYNAMO) is None, reason="Dynamo's side environment is not installed")
def test_dynamo_gives_the_same_scores() -> None:
    side = compare(_stream(), str(python_of(DYNAMO)), lambda line: None)
    assert side["queries"]["deep"] > 0 and side["held_blocks"] > 0
    assert {t.split("/")[0] for t in side["targets"]} >= {
        "ingest_blocks_per_s_vs_dynamo",
        "bytes_per_held_block_vs_dynamo",
        "find_matches_deep_p50_vs_dynamo",
        "remove_worker_ms",
        "longest_busy_ms",
    }


def test_a_target_whose_figure_is_missing_reads_not_measured() -> None:
    """A query class with no queries (here no deep ones) leaves its ratio
    unmeasured: the target is still there, value and within None."""
    figures = {
        impl: {
            "ingest_blocks_per_s": 2e6,
            "bytes_per_held_block": 50.0,
            "match_short_us_p50": 5.0,
            "match_miss_us_p50": 5.0,
            "remove_call_ms": 0.5,
            "ingest_event_max_ms": 1.0,
            "remove_slice_max_ms": 2.0,
        }
        for impl in IMPLS
    }
    targets = _targets(figures)
    for impl in IMPLS[1:]:
        deep = targets[f"find_matches_deep_p50_vs_dynamo/{impl}"]
        assert deep["value"] is None and deep["within"] is None and deep["limit"] == 1.0
        assert targets[f"ingest_blocks_per_s_vs_dynamo/{impl}"]["within"] is True
        assert targets[f"find_matches_short_p50_vs_dynamo/{impl}"]["within"] is False
        assert targets[f"longest_busy_ms/{impl}"]["value"] == 2.0
    assert len(targets) == 7 * len(IMPLS[1:])
    assert all(t["rule"] for t in targets.values())
