"""`kvsidecar bench connector` end to end, short: vLLM's classes on CPU, a
real sidecar, JSON with its targets. Skipped where vLLM is not importable
(the command itself installs vLLM's side environment on first use)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip(
    "vllm.v1.core.sched.scheduler", reason="vLLM is not installed here (see docs/engines.md)"
)

from bench import connector


def test_bench_connector_writes_every_case_and_its_targets(tmp_path):
    out = tmp_path / "connector.json"
    args = argparse.Namespace(steps=5, forward_ms=5.0, cases="abcd", device="cpu", json=str(out))
    assert connector.run(args) == 0
    result = json.loads(out.read_text())
    assert set(result["cases"]) == set("abcd")
    assert set(result["targets"]) == {
        "a_added_pct_of_step",
        "b_worker_ms_vs_sync_copy",
        "b_added_pct_of_step_gpu_target",
    }
    for target in result["targets"].values():
        assert target["within"] == (target["value"] <= target["limit"])
    b, c = result["cases"]["b"]["with"], result["cases"]["c"]["with"]
    assert b["saved_blocks_per_step"] > 0 and b["loaded_blocks_per_step"] == 0
    assert c["loaded_blocks_per_step"] > 0
    assert result["cases"]["a"]["with"]["saved_blocks_per_step"] == 0
    assert result["cases"]["d"]["with"]["all_scheduled_ms_p50"] > 0
    # Layer-wise off and on, side by side where it copies, in the same run.
    b_on, c_on = (
        result["cases"]["b"]["with, layer-wise"],
        result["cases"]["c"]["with, sync load, layer-wise"],
    )
    assert b_on["saved_blocks_per_step"] > 0 and c_on["loaded_blocks_per_step"] > 0
    assert set(result["layer_wise"]) == {"b_save", "c_sync_load"}
    for figures in result["layer_wise"].values():
        on_faster = figures["on_step_ms_p50"] < figures["off_step_ms_p50"]
        assert figures["faster"] == ("layer-wise" if on_faster else "one copy per step")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_kv_cache_on_a_gpu_is_copied_beside_the_forward(tmp_path):
    out = tmp_path / "connector.json"
    args = argparse.Namespace(steps=5, forward_ms=5.0, cases="bc", device="cuda", json=str(out))
    assert connector.run(args) == 0
    result = json.loads(out.read_text())
    assert result["device"] == torch.cuda.get_device_name()
    assert result["targets"]["b_added_pct_of_step_gpu_target"]["note"] == "on a GPU"
    assert result["cases"]["b"]["with"]["saved_blocks_per_step"] > 0
    assert result["cases"]["c"]["with"]["loaded_blocks_per_step"] > 0


def test_bad_arguments_are_refused():
    args = argparse.Namespace(steps=5, forward_ms=5.0, cases="az", device="cpu", json=None)
    assert connector.run(args) == 2
    if not torch.cuda.is_available():
        args = argparse.Namespace(steps=5, forward_ms=5.0, cases="a", device="cuda", json=None)
        assert connector.run(args) == 2
