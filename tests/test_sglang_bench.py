"""`kvsidecar bench sglang`: its command line in the main environment (it
re-runs itself in SGLang's side environment), and a quick run where SGLang
is importable. Timings are never checked: only that it measured."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from sidecar_proc import run_cli

from bench.sglang import TARGET_PAGES, _argv, add_arguments, summary

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def test_help_says_what_it_measures() -> None:
    done = run_cli("bench", "sglang", "--help")
    assert done.returncode == 0
    assert "batch_set_v2" in done.stdout and "page_first" in done.stdout


def test_the_side_environment_gets_the_same_arguments(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--pages", "8,64", "--layout", "layer_first", "--quick", "--json", "r.json"]
    )
    again = parser.parse_args(_argv(args))
    assert vars(again) == {**vars(args), "json": str(Path("r.json").resolve())}


def test_the_targets_read_not_measured_without_1024_pages() -> None:
    setup = SimpleNamespace(page_size=16, layers=4, heads=8, layout="page_first", page_bytes=1)
    figures = {"set_vs_floor": 0.9, "get_vs_floor": 0.7}
    names = {f"{kind}_{TARGET_PAGES}_vs_memcpy" for kind in ("set", "get")}
    measured = summary(setup, {64: figures, TARGET_PAGES: figures}, 1)["targets"]
    assert set(measured) == names
    assert [t["within"] for t in measured.values()] == [True, False]
    unmeasured = summary(setup, {64: figures}, 1)["targets"]
    assert set(unmeasured) == names
    for target in unmeasured.values():
        assert target["value"] is None and target["within"] is None and target["limit"] == 0.8


@pytest.mark.skipif(not HAS_SGLANG, reason="SGLang is not installed here (docs/engines.md)")
def test_a_quick_run_measures_every_size(tmp_path: Path) -> None:
    out = tmp_path / "sglang.json"
    done = run_cli("bench", "sglang", "--quick", "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["by_pages"]) == {"8", "64"}
    for case in result["by_pages"].values():
        assert case["set_gbps"] > 0 and case["get_gbps"] > 0 and case["floor_save_gbps"] > 0
    for target in result["targets"].values():  # the target is for 1,024 pages
        assert target["value"] is None and target["within"] is None
