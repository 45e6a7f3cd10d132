"""`kvsidecar bench ssd --quick` end to end, through the CLI: the figures are
there, every ratio has its floor, and nothing is left behind."""

from __future__ import annotations

import json
import math
import os

import pytest
from shm_helpers import shm_entries

from bench.ssd_io import Tier
from bench.ssd_report import paired_ratio
from kvsidecar.cli import main
from shm.pages import PAGE_KINDS

pytest.importorskip("torch")

CASES = ["16x2048k", "16x256k"]


def positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_ssd_cli_quick_writes_figures_and_cleans_up(tmp_path):
    out, where = tmp_path / "ssd.json", tmp_path / "dir"
    where.mkdir()
    args = ["bench", "ssd", "--quick", "--repeats", "2", "--dir", str(where)]
    assert main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    kinds = ["4k"] + (["huge"] if "page_kind" in data["pools"]["huge"] else [])
    per_block = ("floor_per_block_write_gbps", "write_vs_per_block_floor")
    for figure in ("write", "read"):
        for key in (f"{figure}_gbps", f"floor_{figure}_gbps", f"{figure}_vs_floor", *per_block):
            assert sorted(data[key]) == sorted(kinds), key
            for kind in kinds:
                assert sorted(data[key][kind]) == sorted(CASES), key
                assert all(positive(v) for v in data[key][kind].values()), key
    assert data["pools"]["4k"]["page_kind"] in PAGE_KINDS
    if "huge" in kinds:
        assert data["pools"]["huge"]["page_kind"] in ("thp", "hugetlbfs")
        assert sorted(data["huge_vs_4k"]) == ["floor_read", "floor_write", "read", "write"]
    else:
        assert data["pools"]["huge"]["skipped"]
    get = data["e2e"]["16x256k"]
    for key in ("gbps", "floor_read_gbps", "vs_floor", "tier_read_gbps"):
        assert positive(get[key]), key
    assert get["blocks"] == 16 and get["block_bytes"] == 256 << 10
    # Two repeats, each GET paired with its own floor, as every ratio here.
    assert len(get["seconds"]) == len(get["floor_seconds"]) == 2
    assert get["vs_floor"] == paired_ratio(get["floor_seconds"], get["seconds"])
    assert data["target_vs_floor"] == 0.8 and data["threads"] == 4 and data["repeats"] == 2
    # One target per figure: its ratio to the floor, held to 0.8.
    figures = {
        f"{phase}.{kind}.{case}": data[f"{phase}_vs_floor"][kind][case]
        for phase in ("write", "read")
        for kind in kinds
        for case in CASES
    }
    figures["e2e_get.16x256k"] = get["vs_floor"]
    assert {name: t["value"] for name, t in data["targets"].items()} == figures
    for t in data["targets"].values():
        assert t["limit"] == 0.8 and t["within"] is (t["value"] >= 0.8) and t["rule"]
    assert isinstance(data["page_cache_dropped"], bool) and data["direct_io"] is True
    assert all("available" in v for v in data["fio"].values())
    assert sorted(data["checksum_gbps"]) == ["2048k", "256k"]
    assert data["write_depth"] in ({"2048k": 1, "256k": 8}, {"2048k": None, "256k": None})
    assert os.listdir(where) == []  # files, mounts and mount points all gone
    assert shm_entries(f"kvsbench.{os.getpid()}.") == []
    assert shm_entries(f"kvsidecar.{os.getuid()}.bench{os.getpid()}-") == []
    with open("/proc/self/mounts") as mounts:
        assert str(where) not in mounts.read()


def test_ssd_cli_fails_when_the_tier_reads_nothing(tmp_path, monkeypatch):
    """The floor reads the same blocks into the same slots as the tier: a tier
    read that does nothing must still be caught (each read lands in zeroed
    slots and is checked right after it)."""
    monkeypatch.setattr(Tier, "reader", lambda self, dst: lambda lo, hi: None)
    args = ["bench", "ssd", "--quick", "--block-kib", "256", "--no-e2e", "--no-huge"]
    with pytest.raises(RuntimeError, match=r"read back wrong \(tier read"):
        main([*args, "--dir", str(tmp_path)])
    assert os.listdir(tmp_path) == []
    assert shm_entries(f"kvsbench.{os.getpid()}.") == []


def test_ssd_cli_rejects_bad_arguments(capsys):
    assert main(["bench", "ssd", "--quick", "--block-kib", "6", "--no-e2e"]) == 2
    assert "whole 4 KiB pages" in capsys.readouterr().err
    assert main(["bench", "ssd", "--quick", "--block-kib", "8"]) == 2  # too small end to end
    assert "multiple of 16384" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "ssd", "--counts", "0"])


def test_a_ratio_to_the_floor_pairs_samples_taken_together():
    # The disk slowed down for the second pair: each pair still says 0.5.
    floor, tier = [1.0, 4.0, 1.0], [2.0, 8.0, 2.0]
    assert paired_ratio(floor, tier) == 0.5
    # One slow tier sample moves a ratio of medians (1/2), not the median
    # of the pairs' ratios (1, 1/2, 1).
    assert paired_ratio([1.0, 1.0, 3.0], [1.0, 2.0, 3.0]) == 1.0
    with pytest.raises(ValueError, match="not pairs"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="not pairs"):
        paired_ratio([], [])
