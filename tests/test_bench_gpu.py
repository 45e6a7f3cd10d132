"""`kvsidecar bench gpu`: measures on a GPU, and says plainly that it did not
(exit 0, JSON `skipped`) anywhere else. Never a made-up figure."""

from __future__ import annotations

import json
import math

import pytest

from bench.gpu import unavailable_reason
from kvsidecar.cli import main

pytest.importorskip("torch")


def test_gpu_bench_runs_or_says_why_not(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    reason = unavailable_reason()
    assert data["skipped"] is (reason is not None)
    if reason is not None:
        assert data["reason"] == reason
        assert "nothing measured" in capsys.readouterr().out
        assert not any(k.endswith(("_gbps", "_vs_floor")) for k in data)
        return
    for case in data["cases"].values():
        for key in (
            "floor_d2h_gbps",
            "floor_h2d_gbps",
            "dma_d2h_gbps",
            "dma_h2d_gbps",
            "floor_d2h_queued_gbps",
            "dma_h2d_queued_vs_floor",
        ):
            assert math.isfinite(case[key]) and case[key] > 0, key
        assert case["auto_path"] in ("sm", "dma")
    assert data["targets"] == {}  # held at 1,024 blocks; --quick runs 8 and 64


def test_gpu_bench_rejects_unknown_models(capsys):
    assert main(["bench", "gpu", "--models", "gpt-5"]) == 2
    assert "unknown models" in capsys.readouterr().err


@pytest.mark.parametrize(("layout", "planes", "copied"), [("LHBNC", 48, 48), ("BLHNC", 24, 1)])
def test_vllm_layouts_are_benched_through_their_strided_runs(tmp_path, layout, planes, copied):
    """`--layout LHBNC` etc.: vLLM's per-layer views of one allocation (built
    here on CPU the way the bench builds them on the GPU), copied run by run;
    a cross-layer block as one chunk."""
    from bench.gpu import MODELS, _engine_kv
    from cuda_ext.layouts import kv_planes

    model = MODELS["qwen2.5-0.5b"]  # 24 layers, 2 heads
    kv = kv_planes(_engine_kv(model, 6, layout, "cpu", seed=0), "strided")
    assert (len(kv.planes), len(kv.coalesced().planes)) == (planes, copied)
    assert kv.block_layout().shard_bytes == model.layers * 16 * model.kv_heads * 2 * 64 * 2
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--quick", "--layout", layout, "--json", str(out)]) == 0
