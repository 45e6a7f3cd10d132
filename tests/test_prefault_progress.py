"""Prefaulting a large CPU tier takes seconds: `ShmPool.create` reports its
progress part by part, and the sidecar logs it (bytes done of the total)
about once a second."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from shm_helpers import checked_prefix

from shm.pool import ShmPool
from sidecar.config import load_config
from sidecar.server import server as server_module
from sidecar.server.server import PrefaultLog, Server

PAGE = 4096
MiB = 1 << 20


def test_create_reports_each_part_across_segments() -> None:
    calls: list[tuple[int, int]] = []
    with (
        checked_prefix("progress") as prefix,
        ShmPool.create(
            prefix,
            10 * MiB,
            segment_bytes=4 * MiB,
            progress=lambda done, total: calls.append((done, total)),
            progress_bytes=3 * MiB,
        ) as pool,
    ):
        assert pool.segment_sizes == (4 * MiB, 4 * MiB, 2 * MiB)
        assert not pool.segment_view(1).any()
    # Parts of at most 3 MiB, none straddling a segment: 3+1, 3+1, 2.
    assert [done for done, _ in calls] == [x * MiB for x in (3, 4, 7, 8, 10)]
    assert {total for _, total in calls} == {10 * MiB}


def test_parts_are_whole_pages() -> None:
    calls: list[int] = []
    with (
        checked_prefix("progress") as prefix,
        ShmPool.create(
            prefix, 5 * PAGE, progress=lambda done, _: calls.append(done), progress_bytes=6000
        ),
    ):
        pass
    assert calls == [PAGE, 2 * PAGE, 3 * PAGE, 4 * PAGE, 5 * PAGE]


def test_no_prefault_no_progress() -> None:
    calls: list[int] = []
    with (
        checked_prefix("progress") as prefix,
        ShmPool.create(prefix, MiB, prefault=False, progress=lambda done, _: calls.append(done)),
    ):
        pass
    assert calls == []


def test_prefault_log_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    progress = PrefaultLog(1.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvsidecar.start"):
        for step in range(1, 9):  # a part every 0.4 s
            now[0] += 0.4
            progress(step * (2 << 30), 16 << 30)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "prefaulting the CPU tier: 6.00 of 16.00 GiB (37%)",  # at 1.2 s
        "prefaulting the CPU tier: 12.00 of 16.00 GiB (75%)",  # at 2.4 s
    ]


def test_a_start_logs_its_prefault_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server_module, "PREFAULT_LOG_SECONDS", 0.0)  # every part
    config = load_config(
        env={},
        overrides={
            "instance": f"t{os.getpid()}-prefault",
            "runtime_dir": str(tmp_path),
            "cpu_capacity": 512 * MiB,  # 16 extents (segments) of 32 MiB, a part each
        },
    )
    server = Server(config)
    with caplog.at_level(logging.INFO, logger="kvsidecar.start"):
        server.start()
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "kvsidecar.start"]
        assert len(lines) == 16
        assert lines[7] == "prefaulting the CPU tier: 0.25 of 0.50 GiB (50%)"
        assert lines[-1] == "prefaulting the CPU tier: 0.50 of 0.50 GiB (100%)"
    finally:
        server.close()
    assert os.listdir(tmp_path) == []
