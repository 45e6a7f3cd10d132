"""`kvsidecar analyze` on a small slice of the Mooncake trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from cachesim.analyze import prefix_hits, reuse_distribution
from cachesim.replay import DEFAULT_TRACE
from cachesim.trace import infinite_hits, load_mooncake
from sidecar.control.policies import POLICY_NAMES
from tests.sidecar_proc import ROOT


def _slice(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "slice.jsonl"
    with DEFAULT_TRACE.open() as f:
        path.write_text("".join(next(f) for _ in range(n)))
    return path


def test_prefix_hits_add_up_to_the_unlimited_cache_hits(tmp_path: Path) -> None:
    trace = load_mooncake(_slice(tmp_path, 200), tokens_per_block=64)
    hits = prefix_hits(trace)
    assert hits.sum() == infinite_hits(trace.block_ids, trace.offsets)
    assert np.all(hits <= np.diff(trace.offsets))
    shares = reuse_distribution(trace)
    assert abs(sum(shares.values()) - 1.0) < 1e-9 and shares["1"] > 0.5


def test_analyze_prints_figures_and_draws_a_png(tmp_path: Path) -> None:
    png, out = tmp_path / "curve.png", tmp_path / "a.json"
    cmd = [sys.executable, "-m", "kvsidecar", "analyze", str(_slice(tmp_path, 150))]
    cmd += ["--png", str(png), "--json", str(out), "--tokens-per-block", "128"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "unlimited-cache hit ratio" in proc.stdout and "cached prefix" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())
    assert set(result["hit_ratio"]) == {*POLICY_NAMES, "opt"}
    for c in result["capacities"]:
        opt = result["hit_ratio"]["opt"][str(c)]
        assert all(result["hit_ratio"][p][str(c)] <= opt + 1e-12 for p in POLICY_NAMES)
        assert opt <= result["infinite_hit_ratio"] + 1e-12


def test_analyze_reports_a_missing_trace(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvsidecar", "analyze", str(tmp_path / "none.jsonl")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not found" in proc.stderr


def test_analyze_reports_hash_ids_that_are_not_a_list_of_int64(tmp_path: Path) -> None:
    for n, line in enumerate(['{"hash_ids": 5}', '{"hash_ids": [99999999999999999999999]}']):
        path = tmp_path / f"bad{n}.jsonl"
        path.write_text(line + "\n")
        cmd = [sys.executable, "-m", "kvsidecar", "analyze", str(path)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"bad{n}.jsonl:1" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
