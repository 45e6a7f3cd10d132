"""`kvsidecar bench replay` and `bench index` end to end, through the CLI."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest

from cachesim.belady import belady_hits
from cachesim.replay import replay
from cachesim.report import Progress, format_table, write_json
from cachesim.trace import infinite_hits, load_mooncake
from contract.ids import keys_from_ints
from kvsidecar.cli import main
from sidecar.control.policies import POLICY_NAMES


def write_trace(path, num_requests: int, seed: int = 0) -> None:
    """Conversations: each request extends an earlier one or starts fresh."""
    rng = random.Random(seed)
    requests: list[list[int]] = []
    next_id = 0
    with path.open("w") as f:
        for t in range(num_requests):
            prefix = []
            if requests and rng.random() < 0.7:
                prefix = rng.choice(requests)
            new = list(range(next_id, next_id + rng.randint(1, 4)))
            next_id += len(new)
            requests.append(prefix + new)
            ids = requests[-1]
            row = {"timestamp": t, "input_length": 512 * len(ids), "output_length": 8}
            f.write(json.dumps({**row, "hash_ids": ids}) + "\n")


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, 120)
    return path


def test_replay_cli_writes_hit_ratios(tmp_path, trace_path):
    out = tmp_path / "out" / "replay.json"
    code = main(
        [
            "bench",
            "replay",
            "--trace",
            str(trace_path),
            "--limit",
            "80",
            "--capacities",
            "64,256,1024",
            "--no-peers",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    for key in ("hit_ratio", "opt_hit_ratio", "infinite_hit_ratio", "seconds_per_pass"):
        assert key in data
    assert data["requests"] == 80
    assert data["block_lookups"] > 0
    assert set(data["hit_ratio"]) == set(POLICY_NAMES)
    for c in ("64", "256", "1024"):
        opt = data["opt_hit_ratio"][c]
        assert opt <= data["infinite_hit_ratio"] + 1e-12
        for policy in POLICY_NAMES:
            assert 0.0 <= data["hit_ratio"][policy][c] <= opt + 1e-12


def test_replay_reports_a_missing_trace(tmp_path, capsys):
    assert main(["bench", "replay", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "trace not found" in capsys.readouterr().err


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_no_policy_beats_belady(tmp_path, policy):
    path = tmp_path / "t.jsonl"
    write_trace(path, 60, seed=3)
    trace = load_mooncake(path, tokens_per_block=128)
    keys = keys_from_ints(trace.block_ids)
    for capacity in (4, 16, 60):
        hits = replay(trace, keys, policy, capacity)
        assert hits <= belady_hits(trace.block_ids, trace.offsets, capacity)


def test_unlimited_capacity_reaches_the_infinite_ratio(trace_path):
    trace = load_mooncake(trace_path, tokens_per_block=128)
    keys = keys_from_ints(trace.block_ids)
    hits = replay(trace, keys, "lru", trace.num_unique_blocks())
    assert hits == infinite_hits(trace.block_ids, trace.offsets)


def test_index_cli_quick(tmp_path):
    out = tmp_path / "index.json"
    assert main(["bench", "index", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in (
        "bytes_per_block_1m",
        "bytes_per_block_5m",
        "insert_blocks_per_s",
        "match_blocks_per_s",
        "match_us_2048",
        "evict_us_per_block_small",
        "evict_us_per_block_large",
        "evict_ratio_large_small",
    ):
        assert np.isfinite(data[key]) and data[key] > 0, key
    assert data["match_2048_path_nodes"] >= 64
    t = data["targets"]  # quick sizes are below the 5M blocks the memory target is for
    assert sorted(t) == ["evict_ratio_large_small", "hash_ms_2048_keys", "match_us_2048"]
    assert (t["match_us_2048"]["value"], t["match_us_2048"]["limit"]) == (
        data["match_us_2048"],
        200,
    )
    assert t["hash_ms_2048_keys"]["value"] == data["hash_ms_blake2b"]
    assert all(x["within"] is (x["value"] <= x["limit"]) for x in t.values())


def test_report_helpers(tmp_path):
    text = format_table(["name", "value"], [["a", 1.5], ["longer", 1234567]])
    lines = text.splitlines()
    assert lines[0].startswith("name") and len({len(x) for x in lines[:2]}) == 1
    assert lines[3].endswith("1,234,567")
    path = write_json(tmp_path / "a" / "b.json", {"x": 1})
    written = json.loads(path.read_text())
    assert written.pop("machine")["cpu_count"] >= 1
    assert written == {"x": 1}
    stream = io.StringIO()
    with Progress(10, "p", stream=stream) as bar:  # not a TTY: silent
        bar.update(10)
    assert stream.getvalue() == ""
    with Progress(10, "p", stream=stream, force=True) as bar:
        bar.update(10)
    assert "100.0%" in stream.getvalue()


def test_replay_live_drives_running_sidecars_and_auto_sees_every_lookup(tmp_path):
    """`--live`: every policy at every capacity once more through a private
    sidecar and a KVClient; a tier with no eviction pressure hits exactly as
    replayed, and `auto` in the sidecar is told every request's whole chain."""
    path = tmp_path / "trace.jsonl"
    write_trace(path, 300, seed=3)
    out = tmp_path / "live.json"
    args = ["bench", "replay", "--trace", str(path), "--tokens-per-block", "512"]
    args += ["--capacities", "256,4096"]
    code = main([*args, "--policies", "lru,auto", "--no-peers", "--live", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    ratios, live = data["hit_ratio"], data["live_hit_ratio"]
    lookups = data["block_lookups"]
    for policy in ("lru", "auto"):
        # 4,096 blocks hold the whole trace: nothing is evicted, so the hits are the trace's.
        assert live[policy]["4096"] == ratios[policy]["4096"] == data["infinite_hit_ratio"]
        assert 0 < live[policy]["256"] < live[policy]["4096"]
    for capacity in ("256", "4096"):
        figures = data["live_policy_figures"]["auto"][capacity]
        assert figures["name"] == "auto" and figures["pending"] == 0
        assert figures["observed"] == data["requests"]
        assert figures["observed_blocks"] == lookups
        assert data["live_policy_figures"]["lru"][capacity] == {"name": "lru"}
    target = data["targets"]["live_default_within_1pt_of_best"]
    assert set(target) >= {"value", "limit", "within"}
    assert target["value"] == pytest.approx(  # live at the default, against the best replayed
        100
        * max(
            max(ratios[p][c] for p in ratios) - live[data["default_policy"]][c] for c in live["lru"]
        )
    )


def test_replay_live_refuses_a_tier_below_a_sidecars_minimum(tmp_path, trace_path, capsys):
    args = ["bench", "replay", "--trace", str(trace_path), "--capacities", "100"]
    assert main([*args, "--policies", "lru", "--no-peers", "--live"]) == 2
    assert "--live needs capacities of at least 256 blocks" in capsys.readouterr().err
