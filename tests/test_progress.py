"""Progress on long work, on stderr: `Progress` lines when stderr is not a
terminal, `kvsidecar analyze` and `bench index` progress lines, `kvsidecar
demo` turn by turn; and the demo cleans up after a SIGTERM."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.index import isolated
from cachesim.replay import DEFAULT_TRACE
from cachesim.report import Progress
from tests.sidecar_proc import ROOT, read_line


def test_progress_lines_at_start_every_interval_and_close() -> None:
    stream = io.StringIO()
    with Progress(3, "work: steps", lines_every=0.0, stream=stream) as bar:
        for _ in range(3):
            bar.update()
    lines = stream.getvalue().splitlines()
    assert [re.sub(r", \d+ s$", "", line) for line in lines] == [
        "work: steps 0/3",
        "work: steps 1/3",
        "work: steps 2/3",
        "work: steps 3/3",
        "work: steps 3/3",  # close
    ]
    assert "\r" not in stream.getvalue()


def test_progress_lines_are_rate_limited() -> None:
    stream = io.StringIO()
    with Progress(1000, "p", lines_every=3600.0, stream=stream) as bar:
        for _ in range(1000):
            bar.update()
    assert stream.getvalue().splitlines() == ["p 0/1,000, 0 s", "p 1,000/1,000, 0 s"]


def test_analyze_shows_progress_lines_on_a_stderr_that_is_not_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "slice.jsonl"
    with DEFAULT_TRACE.open() as f:
        path.write_text("".join(next(f) for _ in range(150)))
    proc = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "analyze", str(path), "--tokens-per-block", "128"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == f"analyze: loading {path}"
    steps = [re.fullmatch(r"analyze: policy curves (\d+)/(\d+), \d+ s", ln) for ln in lines[1:]]
    assert all(steps), lines
    done = [(int(m.group(1)), int(m.group(2))) for m in steps if m]
    assert done[0][0] == 0 and done[-1][0] == done[-1][1] > 0
    assert "unlimited-cache hit ratio" in proc.stdout  # the tables stay on stdout


def _busy(seconds: float) -> float:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return seconds


def test_bench_index_children_report_while_they_run(capfd: pytest.CaptureFixture[str]) -> None:
    assert isolated(_busy, 2.0, label="bench index: busy", every=0.1) == 2.0
    lines = capfd.readouterr().err.splitlines()
    assert lines[0] == "bench index: busy ..."
    assert len(lines) >= 2 and all(
        re.fullmatch(r"bench index: busy, \d+ s", ln) for ln in lines[1:]
    )


def test_demo_prints_each_turn_and_cleans_up_on_sigterm() -> None:
    pytest.importorskip("transformers")
    tmp = tempfile.mkdtemp(prefix="kd-", dir="/tmp")  # short: the sidecar's socket is under it
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsidecar", "demo", "--turns", "3", "--new-tokens", "3"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": tmp, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        deadline = time.monotonic() + 300
        while not any(line.startswith("demo: turn A1: ") for line in seen):
            line = read_line(proc.stderr, deadline)
            assert line is not None, "".join(seen)
            seen.append(line)
        workdir = next(ln for ln in seen if ln.startswith("demo: starting")).split()[-1]
        assert os.path.dirname(workdir) == tmp and os.path.isdir(workdir)
        proc.send_signal(signal.SIGTERM)  # mid-chat: five turns to go, a second each
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert not os.path.exists(workdir)
        assert not [n for n in os.listdir(tmp) if n.startswith("kvsidecar-demo-")]  # torch's stay
        assert not [n for n in os.listdir("/dev/shm") if f".demo{proc.pid}-" in n]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
