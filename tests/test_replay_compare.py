"""`bench replay`'s comparison: the trace-consistency check, the generated
traces, the default-vs-best table and target, and libCacheSim's side (whose
tests skip when its side environment is absent; nothing else needs it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cachesim.belady import opt_hits
from cachesim.compare import PEER_PREFIX, TARGET, comparison_rows, default_target
from cachesim.generate import SHAPES, generate
from cachesim.peers import (
    PEERS,
    ensure_side_env,
    peer_hits,
    side_env_python,
)
from cachesim.replay import DEFAULT_TRACE
from cachesim.trace import (
    InconsistentTrace,
    check_prefix_consistent,
    infinite_hits,
    load_mooncake,
    trace_from_requests,
)
from kvsidecar.cli import main
from sidecar.control.policies import DEFAULT_POLICY, POLICY_NAMES
from sideenv import MARKER
from sideenv.specs import LIBCACHESIM, LIBCACHESIM_VERSION

# ---- prefix consistency -----------------------------------------------------


def test_a_prefix_consistent_trace_passes():
    check_prefix_consistent(trace_from_requests([[1, 2, 3], [1, 2, 4], [1, 5], [6], []]))


@pytest.mark.parametrize(
    ("requests", "where"),
    [
        ([[1, 2], [3, 2]], "id 2 after id 1 and after id 3"),
        ([[1, 2], [2]], "id 2 after the start of a request and after id 1"),
        ([[-1, 5], [5]], "id 5 after id -1 and after the start of a request"),
    ],
)
def test_an_id_under_two_parents_is_refused(requests, where):
    with pytest.raises(InconsistentTrace, match="1 hash ids appear under two parents") as err:
        check_prefix_consistent(trace_from_requests(requests))
    assert where in str(err.value)


def test_the_committed_trace_is_prefix_consistent():
    check_prefix_consistent(load_mooncake(DEFAULT_TRACE, tokens_per_block=512))


def test_replay_refuses_an_inconsistent_trace(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [3, 2]}\n')
    assert main(["bench", "replay", "--trace", str(path), "--no-peers"]) == 2
    assert "not prefix-consistent" in capsys.readouterr().err


# ---- generated traces -------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_generated_traces_are_deterministic_and_prefix_consistent(shape):
    trace = generate(shape, 200, seed=7)
    check_prefix_consistent(trace)
    assert trace.num_requests == 200
    assert np.array_equal(trace.block_ids, generate(shape, 200, seed=7).block_ids)
    assert not np.array_equal(trace.hash_ids, generate(shape, 200, seed=8).hash_ids)
    # Every shape reuses prefixes, and not all of them.
    reuse = infinite_hits(trace.hash_ids, trace.hash_offsets) / trace.hash_ids.size
    assert 0.2 < reuse < 0.99


def test_tenants_share_a_system_prompt_per_tenant():
    trace = generate("tenants", 300)
    firsts = {int(trace.hash_ids[trace.hash_offsets[r]]) for r in range(trace.num_requests)}
    assert 1 < len(firsts) <= 40


def test_a_session_turn_extends_the_previous_turn_of_its_session():
    trace = generate("sessions", 400)
    offsets = trace.hash_offsets
    requests = [trace.hash_ids[offsets[r] : offsets[r + 1]].tolist() for r in range(400)]
    seen = {tuple(r) for r in requests}
    # A later turn holds the earlier request, its answer and a new message.
    extended = sum(tuple(r[:-2]) in seen for r in requests if len(r) > 2)
    assert extended == sum(len(r) > 2 for r in requests)


def test_an_unknown_shape_names_the_shapes():
    with pytest.raises(ValueError, match="tenants"):
        generate("nope")


# ---- the table and the target ---------------------------------------------

OURS = {"lru": {10: 0.30, 20: 0.50}, "s3fifo": {10: 0.35, 20: 0.505}}
PEER_RATIOS = {"ARC": {10: 0.31, 20: 0.52}}


def test_the_target_is_the_largest_gap_to_the_best_of_everyone():
    target = default_target("lru", OURS, PEER_RATIOS, [10, 20])
    assert target["gap_points"] == pytest.approx({"10": 5.0, "20": 2.0})
    assert target["best"] == {"10": "s3fifo", "20": PEER_PREFIX + "ARC"}
    assert target["value"] == pytest.approx(5.0) and target["limit"] == 1.0
    assert not target["within"]
    assert "ARC" in target["rule"]


def test_without_peers_the_target_compares_our_policies_only():
    target = default_target("s3fifo", OURS, None, [10, 20])
    assert target["value"] == pytest.approx(0.0) and target["within"]
    assert "libCacheSim" not in target["rule"]


def test_the_comparison_rows():
    headers, rows = comparison_rows("lru", OURS, PEER_RATIOS, {10: 0.4, 20: 0.6}, [10, 20], 100)
    assert headers == [
        "capacity", "of distinct", "opt", "default (lru)", "best", "best is",
        "libcachesim:ARC", "gap (points)",
    ]  # fmt: skip
    assert rows[0] == [10, "10.0%", 0.4, 0.30, 0.35, "s3fifo", 0.31, "5.00"]
    assert rows[1][5] == "libcachesim:ARC"


def test_replay_of_a_generated_trace_writes_the_target(tmp_path, capsys):
    out = tmp_path / "replay.json"
    args = ["bench", "replay", "--synthetic", "rag", "--limit", "60", "--no-peers"]
    assert main([*args, "--capacities", "100,400", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["trace"] == "synthetic:rag" and data["seed"] == 0
    assert data["default_policy"] == DEFAULT_POLICY
    assert set(data["hit_ratio"]) == set(POLICY_NAMES)
    target = data["targets"][TARGET]
    assert set(target) >= {"value", "limit", "within"}
    assert set(target["gap_points"]) == {"100", "400"}
    assert "peer_hit_ratio" not in data
    assert f"target {TARGET}" in capsys.readouterr().out


# ---- libCacheSim's side ----------------------------------------------------


def test_an_installed_side_env_is_reused_without_installing(tmp_path):
    env = tmp_path / "libcachesim"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    assert side_env_python(tmp_path) is None  # no marker: not finished
    (env / MARKER).write_text(LIBCACHESIM.marker() + "\n")
    assert ensure_side_env(tmp_path) == env / "bin" / "python"


@pytest.fixture(scope="module")
def side_python():
    python = side_env_python()
    if python is None:
        pytest.skip("libCacheSim's side environment is not installed (bench replay installs it)")
    return python


def test_peers_stay_under_belady_and_reach_the_unlimited_ratio(side_python):
    trace = generate("tenants", 150, tokens_per_block=128)
    small, unlimited = 200, trace.num_unique_blocks()
    found = peer_hits(side_python, trace, [small, unlimited])
    assert set(found.hits) == set(PEERS) and found.version == LIBCACHESIM_VERSION
    everything = infinite_hits(trace.block_ids, trace.offsets)
    for name, by_c in found.hits.items():
        assert by_c[small] <= opt_hits(trace, small), name
        assert by_c[unlimited] == everything, name
    assert all(by_c[small] > 0 for by_c in found.hits.values())
