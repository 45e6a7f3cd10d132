"""`kvsidecar demo` end to end: the chats run, cached turns load from the CPU
and SSD tiers and match the recompute, and nothing is left behind."""

from __future__ import annotations

import argparse
import os
import re

import pytest

pytest.importorskip("transformers")

from kvsidecar import demo

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_demo_runs_the_chats_bit_exact_and_cleans_up(capsys):
    # Three turns: the third loads blocks that the first turn saved, past
    # where the second stopped; all must be bit-exact on the demo's schedule.
    assert demo.main(["--turns", "3", "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    instance = re.search(r"instance '([^']+)'", out).group(1)
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if re.match(r"[AB][123] ", line)
    }
    assert sorted(rows) == ["A1", "A2", "A3", "B1", "B2", "B3"]
    # columns: turn, prompt, from cpu, from ssd, computed, ...
    assert int(rows["A1"][2]) == int(rows["A1"][3]) == 0
    assert int(rows["B1"][2].replace(",", "")) > 0  # the shared system prompt
    assert int(rows["B2"][3].replace(",", "")) > 0  # B waited longest: back from SSD
    assert out.count("same tokens, bit-exact") == 6
    assert "exit code 0, 0 shm segment(s) left behind" in out
    workdir = re.search(r"left behind; (\S+) removed", out).group(1)
    assert not os.path.exists(workdir)
    assert not [n for n in os.listdir("/dev/shm") if instance in n]


def test_add_parser_registers_the_demo_subcommand():
    parser = argparse.ArgumentParser(prog="kvsidecar")
    demo.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", "--turns", "1", "--no-ssd", "--chunk-tokens", "32"])
    assert args.func is demo.run and args.turns == 1 and args.no_ssd and args.chunk_tokens == 32


@pytest.mark.parametrize(
    "flags", [["--chunk-tokens", "8"], ["--chunk-tokens", "-16"], ["--threads", "0"]]
)
def test_bad_flags_are_refused_before_any_model_or_sidecar_starts(capsys, flags):
    assert demo.main(flags) == 2
    captured = capsys.readouterr()
    assert "--chunk-tokens must be 0 or a multiple of 16" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cpu-capacity", "abc"], "kvsidecar demo: --cpu-capacity: cpu_capacity: 'abc' is not"),
        (["--cpu-capacity", "1KiB"], "kvsidecar demo: --cpu-capacity: cpu_capacity: 1024 is out"),
        (["--model", "/nonexistent"], "kvsidecar demo: --model: /nonexistent holds no config.json"),
    ],
)
def test_a_bad_capacity_or_model_is_one_line_before_any_sidecar_starts(capsys, flags, message):
    assert demo.main([*flags, "--turns", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1
    assert captured.out == ""
