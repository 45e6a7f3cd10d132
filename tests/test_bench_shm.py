"""`kvsidecar bench shm --quick` end to end, through the CLI."""

from __future__ import annotations

import json
import math
import os

import pytest
from shm_helpers import shm_entries

from kvsidecar.cli import main
from shm import copy as shm_copy

pytest.importorskip("torch")


def test_shm_cli_quick_writes_figures_and_cleans_up(tmp_path):
    out = tmp_path / "shm.json"
    assert main(["bench", "shm", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    cases = ["64x8", "2048x32", "2048x1"]
    for key in ("save_gbps", "load_gbps", "floor_save_gbps", "save_vs_floor", "load_vs_floor"):
        assert sorted(data[key]) == sorted(cases), key
        assert all(math.isfinite(v) and v > 0 for v in data[key].values()), key
    for key in ("memcpy_floor_gbps", "prefault_gbps", "prefault_seconds_per_gib"):
        assert math.isfinite(data[key]) and data[key] > 0, key
    assert data["impl"] == shm_copy.IMPL
    if "torch" in shm_copy.IMPLS[1:]:
        assert sorted(data["save_gbps_torch"]) == sorted(cases)
    assert data["by_case"]["2048x32"]["range_bytes"] == 64 * 1024
    # The floor is the faster of numpy's copy and the raw C copy of the same bytes.
    kinds = ("numpy", "raw") if "c" in shm_copy.IMPLS else ("numpy",)
    for d in ("save", "load"):
        for case in cases:
            floors = {k: data[f"floor_{k}_{d}_gbps"][case] for k in kinds}
            assert data[f"floor_{d}_gbps"][case] == max(floors.values())
            assert floors[data[f"floor_{d}_kind"][case]] == max(floors.values())
            ratio = data[f"{d}_gbps"][case] / data[f"floor_{d}_gbps"][case]
            assert data[f"{d}_vs_floor"][case] == ratio
    # The target holds 2 MiB blocks only (2048x32 and 2048x1), each way.
    targets = {name: t["value"] for name, t in data["targets"].items()}
    two_mib = ("2048x32", "2048x1")
    assert targets == {
        f"{d}.{c}": data[f"{d}_vs_floor"][c] for d in ("save", "load") for c in two_mib
    }
    assert all(t["within"] is (t["value"] >= 0.8) for t in data["targets"].values())
    assert shm_entries(f"kvsbench.{os.getpid()}.") == []


def test_shm_cli_rejects_bad_arguments(capsys):
    assert main(["bench", "shm", "--quick", "--impls", "cuda"]) == 2
    assert "unknown or unavailable" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "shm", "--cases", "64x3"])


@pytest.mark.parametrize(
    ("layout", "range_kib", "ranges"), [("LHBNC", 8, 256), ("BLHNC", 2048, 1), ("LBNHC", 64, 32)]
)
def test_shm_cli_copies_a_vllm_layout_through_its_strided_runs(tmp_path, layout, range_kib, ranges):
    """2 MiB blocks of 32 layers and 8 heads: a head-outer layout copies a
    range per head, a cross-layer one a range per block (its bytes checked
    by the bench itself before it reports)."""
    out = tmp_path / "shm.json"
    args = ["bench", "shm", "--quick", "--cases", "2048x32", "--layout", layout]
    assert main([*args, "--total-mib", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    case = data["by_case"]["2048x32"]
    assert data["layout"] == case["layout"] == layout
    assert (case["range_bytes"], case["ranges_per_block"]) == (range_kib * 1024, ranges)
    assert math.isfinite(data["save_vs_floor"]["2048x32"])
    assert shm_entries(f"kvsbench.{os.getpid()}.") == []


@pytest.mark.parametrize("broken", ["save_blocks", "load_blocks"])
def test_shm_cli_fails_when_a_copy_does_nothing(monkeypatch, broken):
    """A save or a load that copies nothing is an error, not a fast figure:
    after the timed rounds the bench clears one side of several blocks, runs
    the timed copy again and compares the bytes."""
    monkeypatch.setattr(shm_copy, broken, lambda *args, **kwargs: None)
    args = ["bench", "shm", "--quick", "--cases", "2048x32", "--total-mib", "8"]
    with pytest.raises(RuntimeError, match="the copy is broken"):
        main([*args, "--impls", shm_copy.IMPL])
    assert shm_entries(f"kvsbench.{os.getpid()}.") == []
