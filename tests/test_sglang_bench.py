"""`kvsidecar bench sglang`: its command line in the main environment (it
re-runs itself in SGLang's side environment), and a quick run where SGLang
is importable. Timings are never checked: only that it measured."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
from sidecar_proc import run_cli

from bench.sglang import _argv, add_arguments

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


@pytest.mark.skipif(not HAS_SGLANG, reason="SGLang is not installed here (docs/engines.md)")
def test_a_quick_run_measures_every_size(tmp_path: Path) -> None:
    out = tmp_path / "sglang.json"
    done = run_cli("bench", "sglang", "--quick", "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["by_pages"]) == {"8", "64"}
    for case in result["by_pages"].values():
        assert case["set_gbps"] > 0 and case["get_gbps"] > 0 and case["floor_save_gbps"] > 0
    assert "targets" not in result  # the target is for 1,024 pages
