"""`kvsidecar bench ttft --quick` end to end, through the CLI, and the trace
follow-up selection it builds its prompts from."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

from hf_helpers import one_torch_thread  # noqa: F401

from bench.ttft import UNIT, follow_ups, prompt_tokens
from sidecar.cli import main


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_follow_ups_are_requests_reusing_half_their_prefix(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"input_length": 1500, "hash_ids": [0, 1, 2]},
        {"input_length": 2000, "hash_ids": [0, 1, 2, 3]},  # 3 of 4 ids seen
        {"input_length": 1800, "hash_ids": [0, 4, 5, 6]},  # 1 of 4: a new conversation
        {"input_length": 900, "hash_ids": [0, 4]},  # 2 of 2
    ]
    trace.write_text("".join(json.dumps({"timestamp": 0, **r}) + "\n" for r in rows))
    found = follow_ups(trace)
    assert [(f.request, f.shared_ids) for f in found] == [(1, 3), (3, 2)]
    assert found[0].tokens == 250 and found[0].cacheable == 3 * UNIT
    assert found[1].tokens == 113 and found[1].cacheable == 112  # up to the last token
    a = prompt_tokens(found[0].hash_ids, found[0].tokens, 1000)
    b = prompt_tokens(rows[0]["hash_ids"], 3 * UNIT, 1000)
    assert (a[: 3 * UNIT] == b).all()  # shared hash ids, shared tokens


def test_ttft_quick_writes_every_figure_and_cleans_up(tmp_path):
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["target_tokens"] for x in r["lengths"]] == [256, 1024]
    for row in [*r["lengths"], *r["sweep"]]:
        assert all(positive(row[k]) for k in ("hit_ms", "recompute_ms", "speedup"))
    assert all(s["loaded_tokens"] > 0 for x in r["lengths"] for s in x["samples"])
    assert [x["prompt_tokens"] for x in r["sweep"]] == [17, 33, 65, 129]
    assert r["break_even_tokens"] in (None, 17, 33, 65, 129)
    assert r["all_hits_from_cpu"] is True
    assert r["sidecar_exit_code"] == 0 and r["shm_leftovers"] == []
    assert r["machine"]["cpu_count"] > 0
