"""bench/targets.py: the `targets` object every benchmark's JSON carries, and
the load target `bench ttft` derives from its sweep."""

from __future__ import annotations

import pytest

from bench.targets import at_least, at_most, missed, verdict


def test_a_target_is_within_only_when_measured_and_on_the_right_side():
    assert at_least(0.8, 0.8, "r") == {"value": 0.8, "limit": 0.8, "within": True, "rule": "r"}
    assert at_least(0.79, 0.8, "r")["within"] is False
    assert at_most(200.0, 200, "r")["within"] is True
    assert at_most(200.1, 200, "r")["within"] is False
    for make in (at_least, at_most):
        assert make(None, 1.0, "r")["within"] is None  # not measured is not met


def test_verdict_names_what_was_missed_or_not_measured():
    targets = {
        "a": at_least(1.0, 0.8, "r"),
        "b": at_least(0.5, 0.8, "r"),
        "c": at_most(None, 2.0, "r"),
    }
    assert missed(targets) == ["b", "c"]
    assert verdict(targets) == "targets: 2 of 3 not met: b 0.5, c not measured"
    assert verdict({"a": targets["a"]}) == "targets: all 1 met"
    many = {f"t{i}": at_least(0.1, 0.8, "r") for i in range(8)}
    assert verdict(many).endswith("t5 0.1 and 2 more")


def test_ttft_load_target_takes_the_32_block_row_and_the_floor_of_its_bytes():
    pytest.importorskip("torch")
    from bench.ttft_measure import load_target

    parts = {"cpu_lookup_ms": 0.5, "cpu_load_ms": 1.5, "cpu_build_ms": 0.5}
    sweep = [
        {"cached_tokens": 256, "cpu_lookup_load_ms": 1.0, **parts},
        {"cached_tokens": 512, "cpu_lookup_load_ms": 2.5, **parts},
    ]
    floor, target = load_target(sweep, 4096, "cpu", 16)
    assert floor["blocks"] == 32 and floor["bytes"] == 32 * 4096 and floor["copy_ms"] > 0
    assert target["value"] == 2.5
    assert target["parts_ms"] == {"lookup": 0.5, "load": 1.5, "build": 0.5}
    assert target["limit"] == pytest.approx(1.5 * floor["copy_ms"] + 0.3)
    assert target["within"] is (target["limit"] >= 2.5)
    _, none = load_target(sweep[:1], 4096, "cpu", 16)
    assert none["value"] is None and none["within"] is None and "parts_ms" not in none
