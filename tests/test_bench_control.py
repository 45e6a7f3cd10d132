"""`kvsidecar bench control --quick` end to end, through the CLI: every figure
comes out, and the sidecar, the echo server and the clients leave nothing behind."""

from __future__ import annotations

import ctypes
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
    argv = ["bench", "control", "--quick", "--no-calls", "--blocks", "5000", "--json", str(out)]
    assert main(argv) == 0
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
    # The control plane is timed: every lookup asked the sidecar (the hot
    # index would answer KVClient.lookup in the client's process).
    timed = sum(
        r[figure][n][c]["samples"]
        for figure in ("lookup_rtt_us", "lookup_keys_rtt_us")
        for n in BLOCKS
        for c in CLIENTS
    )
    assert r["sidecar_requests"]["lookup"] >= timed
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


# ---- the per-call rows (bench/control_calls.py, bench/peers/) ----------------------

QUICK_TRANSFERS = [f"{kind}.{g}.{n}" for kind in ("save", "load") for g in ("2MiB", "128KiB")
                   for n in (1, 4)]  # fmt: skip
QUICK_LOOKUPS = ["lookup_hit.256", "lookup_miss.256"]


def check_rows(rows: dict, names: list[str], what: str) -> None:
    assert sorted(rows) == sorted(names), what
    for name in names:
        s = rows[name]
        assert all(positive(s[q]) for q in ("p50", "p99", "mean", "samples")), (what, name)
        assert s["p50"] <= s["p99"], (what, name)


def calls_segments() -> list[str]:
    prefixes = tuple(f"kvsidecar.{os.getuid()}.{tag}" for tag in ("calls", "rates"))
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefixes)]


def test_control_calls_quick_without_peers_writes_every_row_and_cleans_up(tmp_path):
    out = tmp_path / "calls.json"
    argv = ["bench", "control", "--quick", "--calls-only", "--no-peers", "--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    c = r["calls"]

    assert sorted(c["rows_us"]) == ["kvsidecar", "memcpy"]
    check_rows(c["rows_us"]["memcpy"], QUICK_TRANSFERS, "memcpy")  # the floor has no lookup
    check_rows(c["rows_us"]["kvsidecar"], QUICK_TRANSFERS + QUICK_LOOKUPS, "kvsidecar")
    for row in QUICK_TRANSFERS:
        memcpy, ours = c["rows_us"]["memcpy"][row], c["rows_us"]["kvsidecar"][row]
        separate = memcpy["p50"] / ours["p50"]
        if row.endswith(".4"):  # the largest transfer: paired with the floor in kvsidecar's worker
            assert positive(ours["vs_floor"]) and positive(ours["floor_p50"]), row
            assert ours["samples"] >= 11, row  # paired_min_samples
            assert c["vs"][row] == {"memcpy": ours["vs_floor"], "memcpy_separate": separate}
        else:
            assert "vs_floor" not in ours, row
            assert c["vs"][row] == {"memcpy": separate, "memcpy_separate": separate}, row
    assert c["systems"]["kvsidecar"]["notes"] == ""  # nothing left unpaired for want of memory
    assert all(c["vs"][row] == {} for row in QUICK_LOOKUPS)
    assert all(not s["error"] and s["version"] for s in c["systems"].values())
    assert c["geometries"]["2MiB"]["block_bytes"] == 2 << 20
    assert c["geometries"]["128KiB"]["block_bytes"] == 128 << 10

    for clients in ("4", "16"):
        rates = c["lookup_rates_rps"][clients]
        assert positive(rates["raw"]) and positive(rates["lookup"])
        assert rates["lookup_vs_raw"] == rates["lookup"] / rates["raw"]
    # Without peers and without 2,048-block rows, only the rate target is judged.
    assert sorted(r["targets"]) == ["calls.lookup_rate_4_clients_vs_raw"]
    target = r["targets"]["calls.lookup_rate_4_clients_vs_raw"]
    assert target["value"] == c["lookup_rates_rps"]["4"]["lookup_vs_raw"]
    assert target["limit"] == pytest.approx(1.06)
    assert target["within"] == (target["value"] >= target["limit"])
    assert calls_segments() == []


def summary(p50: float) -> dict:
    return {"p50": p50, "p99": p50, "mean": p50, "samples": 3}


class ClockedSystem:
    """A System whose save takes `cost` ns of a shared fake clock, in order."""

    def __init__(self, clock: list[int], costs: list[int], log: list[str], name: str) -> None:
        self.clock, self.costs, self.log, self.name = clock, costs, log, name

    def save(self, tokens, block_ids) -> int:
        self.clock[0] += self.costs[len(self.log) % len(self.costs)]
        self.log.append(self.name)
        return len(tokens)


def test_timed_pairs_each_call_with_the_floor_in_alternating_order(monkeypatch):
    from bench.peers import calls
    from bench.peers.calls import Spec, timed

    now, ours_log, floor_log = [0], [], []
    monkeypatch.setattr(calls.time, "perf_counter_ns", lambda: now[0])
    # Calls alternate between a fast and a slow machine: ours 4 or 8 ms, the floor 2 or 8.
    ours = ClockedSystem(now, [4_000_000, 8_000_000], ours_log, "ours")
    floor = ClockedSystem(now, [2_000_000, 8_000_000], floor_log, "floor")
    order: list[str] = []

    def step(system: ClockedSystem) -> int:
        order.append(system.name)
        return system.save([1], None)

    spec = Spec(seconds=0.0, min_samples=2, warmup=1, paired_min_samples=6)
    row = timed(lambda: step(ours), 1, "save", spec, floor=lambda: step(floor))
    assert order[2:] == ["floor", "ours", "ours", "floor"] * 3  # after one warm-up each
    assert row["samples"] == 6  # paired_min_samples, not min_samples
    order.clear()
    assert timed(lambda: step(ours), 1, "save", spec)["samples"] == 2  # unpaired
    # Each pair ran on one machine: ratios 1.0 (slow) and 0.5 (fast), median 0.75;
    # the ratio of the two p50s (5 / 6 ms) would say 0.83.
    assert row["vs_floor"] == pytest.approx(0.75)
    assert row["p50"] == pytest.approx(6000.0) and row["floor_p50"] == pytest.approx(5000.0)


def test_the_floor_is_paired_only_where_its_buffers_fit():
    from bench.peers.calls import floor_fits

    assert floor_fits(1 << 20)
    assert not floor_fits(1 << 50)  # a petabyte


def test_the_same_memory_floor_copies_the_rows_bytes_between_the_engine_and_the_slots(
    monkeypatch,
):
    """kvsidecar's paired floor moves the bytes the row moves, in the memory
    the row uses: a save's floor puts each layer's span of the blocks into
    the slots the forgotten save used, a load's floor the slots' bytes into
    the engine's tensors; and it is paired where no room is left for buffers."""
    import numpy as np
    import torch

    from bench.peers import calls
    from bench.peers.calls import GEOMETRIES, LOOKUP_SET, SAVE_SET, PairedFloor, Spec, token_ids
    from bench.peers.kvsidecar_worker import KvsidecarSystem, SameMemoryFloor

    g, n = GEOMETRIES["2MiB"], 4
    tpb = g["tokens_per_block"]
    system = KvsidecarSystem()
    system.open(g, n, 2 * n + 16)
    try:
        kv = system._kv
        for i, t in enumerate(kv):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
        spec = Spec(transfer_blocks=[1, n], geometries=["2MiB"], paired_floor=True)
        notes: list[str] = []
        paired = PairedFloor(lambda: SameMemoryFloor(system), spec, "2MiB", notes)
        ids, saved = np.arange(n), token_ids(n * tpb, SAVE_SET)
        assert system.save(saved, ids) == n * tpb
        system.forget(saved)
        assert system._freed is None  # no floor yet: forgets note nothing
        assert paired.call("save", saved, ids) is not None  # opens the floor
        assert system.save(saved, ids) == n * tpb
        system.forget(saved)
        slots = system._freed
        assert slots is not None and slots.size == n
        views = {int(a): np.ctypeslib.as_array((ctypes.c_uint8 * (2 << 20)).from_address(int(a)))
                 for a in slots}  # fmt: skip
        for v in views.values():
            v[:] = 0
        monkeypatch.setattr(calls, "floor_fits", lambda _: False)  # paired all the same
        floor = paired.call("save", saved, ids)
        assert floor is not None and paired.call("save", saved, ids[:1]) is None
        assert floor() == n * tpb
        engine = b"".join(t.numpy().tobytes() for t in kv)  # each layer's n blocks, layer by layer
        assert b"".join(views[int(a)].tobytes() for a in slots) == engine
        assert notes == []

        loaded = token_ids(n * tpb, LOOKUP_SET)
        assert system.save(loaded, ids) == n * tpb
        held = system.slot_addresses(loaded)
        assert held is not None and held.size == n
        cache = b"".join(bytes((ctypes.c_uint8 * (2 << 20)).from_address(int(a))) for a in held)
        for t in kv:
            t.zero_()
        assert paired.call("load", loaded, ids)() == n * tpb
        assert b"".join(t.numpy().tobytes() for t in kv) == cache
        with pytest.raises(ValueError, match="consecutive"):
            paired.call("load", loaded, ids[::-1].copy())()
        paired.close()
    finally:
        system.close()
    assert not system.problems


def test_merge_keeps_the_paired_figures_only_where_every_round_has_them():
    from bench.control_calls import merge
    from bench.peers import WorkerResult

    paired = {**summary(10.0), "vs_floor": 0.8, "floor_p50": 8.0}
    rounds = [
        WorkerResult("v", {"a": paired, "b": paired}, "x"),
        WorkerResult("v", {"a": {**paired, "vs_floor": 1.0}, "b": summary(12.0)}, "x"),
    ]
    rows = merge(rounds).rows
    assert rows["a"]["vs_floor"] == pytest.approx(0.9) and rows["a"]["floor_p50"] == 8.0
    assert "vs_floor" not in rows["b"] and rows["b"]["p50"] == 11.0
    assert merge(rounds).notes == "x"


def test_calls_targets_follow_the_issue_rules_and_say_what_was_not_measured():
    from bench.control_calls import ratios, targets

    rows = {
        "memcpy": {"save.2MiB.2048": summary(900.0), "save.2MiB.1": summary(50.0)},
        "kvsidecar": {
            "save.2MiB.2048": summary(1000.0),
            "save.2MiB.1": summary(400.0),
            "lookup_hit.256": summary(30.0),
            "save.128KiB.1": summary(100.0),
        },
        "aibrix": {
            "save.2MiB.2048": summary(4000.0),
            "save.2MiB.1": summary(500.0),
            "lookup_hit.256": summary(20.0),
            "save.128KiB.1": summary(10.0),
        },
    }
    r = {
        "rows_us": rows,
        "vs": ratios(rows),
        "systems": {"lmcache": {"error": "the lmcache worker exited 1"}},
        "lookup_rates_rps": {"4": {"lookup_vs_raw": 1.2}},
    }
    t = targets(r, peers=True)

    assert t["calls.save.2MiB.2048.vs_memcpy"]["value"] == pytest.approx(0.9)  # speed share
    assert t["calls.save.2MiB.2048.vs_memcpy"]["within"] is True
    assert "could not be paired" in t["calls.save.2MiB.2048.vs_memcpy"]["rule"]
    # Paired calls, where the worker had them, decide instead of the separate p50s.
    rows["kvsidecar"]["save.2MiB.2048"]["vs_floor"] = 0.85
    paired = targets({**r, "vs": ratios(rows)}, peers=True)["calls.save.2MiB.2048.vs_memcpy"]
    assert paired["value"] == pytest.approx(0.85) and paired["within"] is False
    assert "paired back to back" in paired["rule"]
    assert ratios(rows)["save.2MiB.2048"]["memcpy_separate"] == pytest.approx(0.9)
    assert t["calls.save.2MiB.1.vs_aibrix"]["value"] == pytest.approx(0.8)
    assert t["calls.save.2MiB.1.vs_aibrix"]["within"] is True
    assert t["calls.lookup_hit.256.vs_aibrix"]["within"] is False  # 1.5x AIBrix's
    # AIBrix targets only the one-block 2 MiB calls and the lookups.
    assert "calls.save.128KiB.1.vs_aibrix" not in t
    assert "calls.save.2MiB.2048.vs_aibrix" not in t
    # Every row has an LMCache target; unmeasured, it says why instead of a verdict.
    lmcache = {k: v for k, v in t.items() if k.endswith(".vs_lmcache")}
    assert len(lmcache) == len(rows["kvsidecar"])
    assert all(v["within"] is None and v["value"] is None for v in lmcache.values())
    assert all("exited 1" in v["not_measured"] for v in lmcache.values())
    assert t["calls.lookup_rate_4_clients_vs_raw"]["within"] is True
    assert "calls.save.2MiB.1.vs_lmcache" not in targets(r, peers=False)


@pytest.mark.parametrize("peer", ["aibrix", "lmcache"])
def test_peer_worker_gives_every_row_in_its_side_environment(peer, tmp_path):
    from bench.peers import SYSTEMS, run_worker
    from bench.peers.calls import Spec
    from sideenv import python_of

    env = SYSTEMS[peer]
    assert env is not None
    if python_of(env) is None:
        pytest.skip(f"the {peer} side environment is not installed (python -m sideenv ensure)")
    spec = Spec(
        transfer_blocks=[1, 2],
        lookup_tokens=[32],
        geometries=["2MiB"],
        seconds=0.01,
        min_samples=2,
        warmup=1,
        workdir=str(tmp_path),
    )
    result = run_worker(peer, spec, timeout=600)

    assert result.error == ""
    assert result.version.startswith(
        {"aibrix": "aibrix-kvcache 0.8.0", "lmcache": "lmcache 0.5.6"}[peer]
    )
    names = [f"{k}.2MiB.{n}" for k in ("save", "load") for n in (1, 2)]
    check_rows(result.rows, [*names, "lookup_hit.32", "lookup_miss.32"], peer)
    # LMCache's server made its L1 segment (bench/peers/lmcache_worker.py names it) and removed it
    assert [n for n in os.listdir("/dev/shm") if n.startswith("kvsbench_lmcache_")] == []
