"""cachesim.trace: Mooncake JSONL loading, expansion to small blocks, infinite-cache hits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cachesim.trace import expand_ids, infinite_hit_ratio, infinite_hits, load_mooncake
from kvsidecar import cli

ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 5, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 3]},
    {"timestamp": 9, "input_length": 600, "output_length": 30, "hash_ids": [4, 5]},
    {"timestamp": 12, "input_length": 2000, "output_length": 40, "hash_ids": [0, 1, 3, 6]},
]


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    return path


def test_load_keeps_requests_and_fields(trace_path):
    trace = load_mooncake(trace_path, tokens_per_block=512)
    assert trace.num_requests == 4
    assert trace.blocks_per_hash == 1
    assert trace.hash_offsets.tolist() == [0, 3, 6, 8, 12]
    assert trace.request(3).tolist() == [0, 1, 3, 6]
    assert trace.timestamps.tolist() == [0, 5, 9, 12]
    assert trace.input_lengths.tolist() == [1500, 1100, 600, 2000]
    assert trace.output_lengths.tolist() == [10, 20, 30, 40]
    assert trace.block_ids.dtype == np.int64


def test_expansion_to_16_token_blocks(trace_path):
    trace = load_mooncake(trace_path, tokens_per_block=16)
    assert trace.blocks_per_hash == 32
    assert trace.tokens_per_block == 16
    assert trace.offsets.tolist() == [0, 96, 192, 256, 384]
    first = trace.request(0)
    assert first[:33].tolist() == [*range(32), 32]
    assert first[-1] == 2 * 32 + 31
    assert trace.num_lookups == 12 * 32
    assert trace.num_unique_blocks() == 7 * 32


def test_expand_ids_children_in_order():
    assert expand_ids(np.array([3, 1]), 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert expand_ids(np.array([3, 1]), 1).tolist() == [3, 1]


def test_infinite_hits_same_at_both_granularities(trace_path):
    trace = load_mooncake(trace_path, tokens_per_block=16)
    # request 1 hits [0, 1], request 3 hits [0, 1, 3]
    assert infinite_hits(trace.hash_ids, trace.hash_offsets) == 5
    assert infinite_hits(trace.block_ids, trace.offsets) == 5 * 32
    assert infinite_hit_ratio(trace) == pytest.approx(5 / 12)


def test_repeats_within_one_request_are_not_hits():
    ids = np.array([7, 7, 7, 7])
    offsets = np.array([0, 2, 4])
    assert infinite_hits(ids, offsets) == 2


def test_limit_reads_only_the_first_requests(trace_path):
    trace = load_mooncake(trace_path, tokens_per_block=256, limit=2)
    assert trace.num_requests == 2
    assert trace.num_lookups == 6 * 2


@pytest.mark.parametrize("limit", ["0", "-1", "1.5", "\u0662"])
@pytest.mark.parametrize("command", [["analyze"], ["bench", "replay", "--trace"]])
def test_a_limit_below_one_is_refused_as_an_argument(trace_path, capsys, command, limit):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, str(trace_path), "--limit", limit])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert f"error: argument --limit: expected a positive integer: {limit!r}" in captured.err
    assert captured.out == ""


def test_bad_inputs_are_reported(tmp_path, trace_path):
    with pytest.raises(ValueError, match="must divide 512"):
        load_mooncake(trace_path, tokens_per_block=24)
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_mooncake(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a Mooncake trace line"):
        load_mooncake(bad)
