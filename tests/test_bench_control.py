"""`kvsidecar bench control --quick` end to end, through the CLI: every figure
comes out, and the sidecar, the echo server and the clients leave nothing behind."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from shm_helpers import shm_entries

from bench.fleet import Timing, timed_rotation
from kvsidecar.cli import main

pytest.importorskip("torch")

BLOCKS = ["1", "64", "2048", "5000"]  # 5,000: a longer request added with --blocks
CLIENTS = ["1", "4"]
LATENCY_FIGURES = [
    "lookup_rtt_us",
    "lookup_keys_rtt_us",
    "load_plan_rtt_us",
    "save_plan_rtt_us",
    "load_full_us",
    "save_full_us",
]


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def check_latencies(table: dict, name: str) -> None:
    assert sorted(table) == sorted(BLOCKS), name
    for n in BLOCKS:
        assert sorted(table[n]) == sorted(CLIENTS), (name, n)
        for c in CLIENTS:
            s = table[n][c]
            assert all(positive(s[q]) for q in ("p50", "p99", "mean", "samples")), (name, n, c)
            assert s["p50"] <= s["p99"], (name, n, c)


def test_control_cli_quick_writes_every_figure_and_cleans_up(tmp_path):
    out = tmp_path / "control.json"
    assert main(["bench", "control", "--quick", "--blocks", "5000", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["block_counts"] == [1, 64, 2048, 5000]

    for shape in ("lookup", "load_save", "load_save_full"):
        check_latencies(r["floor_rtt_us"][shape], f"floor_rtt_us.{shape}")
    for figure in LATENCY_FIGURES:
        check_latencies(r[figure], figure)
        for n in BLOCKS:
            for c in CLIENTS:
                assert all(positive(v) for v in r["vs_floor"][figure][n][c].values()), figure
    assert r["vs_floor_uses"]["load_full_us"] == "floor_rtt_us.load_save_full"  # 2 round trips
    assert r["vs_floor_uses"]["load_plan_rtt_us"] == "floor_rtt_us.load_save"
    assert sorted(r["hash_us"]) == sorted(BLOCKS)
    assert all(positive(r["hash_us"][n]["p50"]) for n in BLOCKS)
    for rate in ("raw_rate_rps", "lookup_rate_rps", "lookup_keys_rate_rps", "lookup_rate_vs_raw"):
        assert sorted(r[rate]) == sorted(CLIENTS), rate
        assert all(positive(v) for v in r[rate].values()), rate

    for codec in ("msgspec_struct", "msgspec_dict", "msgpack_dict"):
        assert sorted(r["encode_us"][codec]) == ["complete", "load", "lookup"], codec
        assert all(positive(v) for v in r["encode_us"][codec].values()), codec
    assert sorted(r["keys_encode_us"]) == ["msgpack_list", "msgspec_list", "raw_frame"]
    assert all(positive(v) for v in r["keys_encode_us"].values())

    for name, target in r["targets"].items():
        assert positive(target["value"]) and positive(target["limit"]), name
        assert isinstance(target["within"], bool), name

    # The lookup target is judged on its three terms measured side by side.
    paired = r["lookup_paired_us"]
    assert sorted(paired) == ["floor", "floor_after_hash", "hash", "lookup"]
    assert len({s["samples"] for s in paired.values()}) == 1  # one call of each per round
    target = r["targets"]["lookup_2048_p50_us"]
    assert target["value"] == paired["lookup"]["p50"]
    assert target["limit"] == pytest.approx(paired["floor"]["p50"] + paired["hash"]["p50"] + 100)
    assert target["within"] == (target["value"] <= target["limit"])
    separate = target["from_separate_cases"]
    assert separate["value"] == r["lookup_rtt_us"]["2048"]["1"]["p50"]
    after = target["with_floor_after_hash"]
    assert after["limit"] == pytest.approx(
        paired["floor_after_hash"]["p50"] + paired["hash"]["p50"] + 100
    )
    assert after["within"] == (target["value"] <= after["limit"])

    # So is the rate target: its terms run in rotating slices, side by side.
    rates = r["rates_paired_rps"]
    assert all(positive(rates[name]) for name in ("raw", "lookup", "lookup_keys"))
    rate_target = r["targets"]["lookup_rate_4_clients_vs_raw"]
    assert rate_target["value"] == rates["lookup_vs_raw"] == rates["lookup"] / rates["raw"]
    assert rates["lookup_keys_vs_raw"] == rates["lookup_keys"] / rates["raw"]
    assert rate_target["within"] == (rate_target["value"] >= rate_target["limit"])
    assert rate_target["from_separate_cases"]["value"] == r["lookup_rate_vs_raw"]["4"]

    assert r["sidecar_exit_code"] == 0
    assert r["shm_leftovers"] == []
    assert shm_entries(f"kvsidecar.{os.getuid()}.{r['sidecar_instance']}") == []


@pytest.mark.parametrize("blocks", ["0", "64,x", "", str(1 << 21)])
def test_control_refuses_block_counts_it_cannot_measure(blocks, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "control", "--quick", "--blocks", blocks])
    assert info.value.code == 2 and "--blocks" in capsys.readouterr().err


def test_timed_rotation_times_each_step_once_per_round_in_rotating_order():
    order: list[str] = []
    steps = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    synced: list[bool] = []
    out = timed_rotation(
        steps, Timing(seconds=0.0, warmup=1, min_samples=4), lambda: synced.append(True)
    )

    assert synced == [True]
    assert order[:3] == ["a", "b", "c"]  # the warm-up round
    assert order[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert {name: s.latency_ns.size for name, s in out.items()} == {"a": 4, "b": 4, "c": 4}
    assert all((s.latency_ns > 0).all() and s.wall_s > 0 for s in out.values())


def test_timed_rotation_runs_the_untimed_prelude_right_before_its_step_only():
    order: list[str] = []
    steps = {"a": lambda: order.append("a"), "b": lambda: time.sleep(0.002)}
    before = {"b": lambda: (order.append("before b"), time.sleep(0.05))}
    out = timed_rotation(steps, Timing(seconds=0.0, warmup=0, min_samples=3), lambda: None, before)

    assert order == ["a", "before b", "before b", "a", "a", "before b"]
    # b's 2 ms are timed, its prelude's 50 ms are not
    assert (out["b"].latency_ns >= 2_000_000).all() and (out["b"].latency_ns < 40_000_000).all()
