"""Client processes that run closed-loop benchmark tasks in lockstep.

A `Fleet` spawns N processes (multiprocessing "spawn": nothing inherited from
the parent but the arguments) that each build one state object and run named
methods of it. A timed method runs on the first k processes at once: each
does its set-up and warm-up, calls `sync()` (which reports "ready"), and
starts its timed loop when the parent has seen every "ready" and sent "go".
A method that raises sends its traceback back, and the parent raises it.

Task methods take `sync` first: `state.method(sync, **kwargs)`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

GO = "go"


class Timing(NamedTuple):
    """How long one timed task runs: `warmup` untimed calls, then calls for at
    least `seconds` and at least `min_samples` calls."""

    seconds: float
    warmup: int
    min_samples: int


@dataclass(frozen=True)
class Samples:
    """What one process measured: each call's latency, and the loop's wall time."""

    latency_ns: np.ndarray
    wall_s: float

    @staticmethod
    def merge(parts: Sequence[Samples]) -> Samples:
        """One process's samples of the same case over several rounds."""
        return Samples(np.concatenate([s.latency_ns for s in parts]), sum(s.wall_s for s in parts))


def timed_loop(
    step: Callable[[], Any],
    timing: Timing,
    sync: Callable[[], None],
    after: Callable[[Any], None] | None = None,
) -> Samples:
    """Warm up, wait for "go", then time `step()` calls; `after(result)` runs
    untimed after each call (e.g. to cancel the plan a request created)."""
    for _ in range(timing.warmup):
        out = step()
        if after is not None:
            after(out)
    sync()
    clock = time.perf_counter_ns
    latencies: list[int] = []
    start = clock()
    end = start + int(timing.seconds * 1e9)
    while True:
        t0 = clock()
        out = step()
        t1 = clock()
        latencies.append(t1 - t0)
        if after is not None:
            after(out)
        if t1 >= end and len(latencies) >= timing.min_samples:
            break
    return Samples(np.array(latencies, dtype=np.int64), (clock() - start) / 1e9)


def timed_rotation(
    steps: dict[str, Callable[[], Any]],
    timing: Timing,
    sync: Callable[[], None],
    untimed_before: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, Samples]:
    """`timed_loop` for several steps measured side by side: every round
    times each step once, starting one step later each round, so a drift in
    the shared machine's speed (often +-20% over seconds on these VMs) hits
    all of them alike and no step always runs right after the same other.
    `untimed_before[name]`, if given, runs right before step `name`, untimed."""
    names = list(steps)
    before = untimed_before or {}
    for _ in range(timing.warmup):
        for name in names:
            if name in before:
                before[name]()
            steps[name]()
    sync()
    clock = time.perf_counter_ns
    latencies: dict[str, list[int]] = {name: [] for name in names}
    start = clock()
    end = start + int(timing.seconds * 1e9)
    rounds = 0
    while True:
        for k in range(len(names)):
            name = names[(rounds + k) % len(names)]
            if name in before:
                before[name]()
            t0 = clock()
            steps[name]()
            latencies[name].append(clock() - t0)
        rounds += 1
        if clock() >= end and rounds >= timing.min_samples:
            break
    wall = (clock() - start) / 1e9
    return {n: Samples(np.array(v, dtype=np.int64), wall) for n, v in latencies.items()}


def summarize(samples: Sequence[Samples]) -> dict[str, float]:
    """p50 / p99 / mean latency in µs over every process's calls, the number of
    calls, and the closed-loop rate (the sum of each process's calls/s)."""
    lat = np.concatenate([s.latency_ns for s in samples]) / 1e3
    return {
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "mean": float(lat.mean()),
        "samples": int(lat.size),
        "rate_rps": float(sum(s.latency_ns.size / s.wall_s for s in samples)),
    }


class _Stop(Exception):
    """The parent asked the process to exit while it waited for "go"."""


def _serve(conn: Any, state_type: type) -> None:
    _run_tasks(conn, state_type())
    # Everything the state owned is closed by now; skip the interpreter's
    # teardown, which takes ~0.5 s per process once torch is imported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_tasks(conn: Any, state: Any) -> None:
    def sync() -> None:
        conn.send(("ready", None))
        msg = conn.recv()
        if msg != GO:
            raise _Stop

    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg == GO:  # a "go" for a task that had already failed here
                continue
            name, kwargs = msg
            try:
                out = getattr(state, name)(sync, **kwargs)
            except _Stop:
                break
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", out))
    finally:
        state.close()


class Fleet:
    """N spawned processes, each holding a `state_type()`; see the module doc."""

    def __init__(self, state_type: type, size: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        for i in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(child, state_type), name=f"bench-client-{i}", daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def size(self) -> int:
        return len(self._procs)

    def call(
        self,
        name: str,
        count: int,
        kwargs: Sequence[dict[str, Any]] | None = None,
        timeout: float = 120.0,
    ) -> list:
        """Run task `name` on processes 0..count-1 (kwargs[i] for process i) in
        lockstep; returns their results in order. A task that never calls
        `sync` simply runs. RuntimeError if a process fails, dies or takes
        more than `timeout` seconds for a step."""
        kwargs = list(kwargs) if kwargs is not None else [{}] * count
        if len(kwargs) != count or not 1 <= count <= self.size:
            raise ValueError(f"{count} processes of {self.size}, {len(kwargs)} kwargs")
        for i in range(count):
            self._conns[i].send((name, kwargs[i]))
        first = [self._recv(i, name, timeout) for i in range(count)]
        if all(kind == "ok" for kind, _ in first):
            return [out for _, out in first]
        for i in range(count):
            self._conns[i].send(GO)
        results = []
        for i, (kind, out) in enumerate(first):
            results.append(out if kind == "ok" else self._recv(i, name, timeout)[1])
        return results

    def _recv(self, i: int, task: str, timeout: float) -> tuple[str, Any]:
        conn, proc = self._conns[i], self._procs[i]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.5):
            if not proc.is_alive():
                raise RuntimeError(f"client process {i} died (exit {proc.exitcode}) in {task}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"client process {i} did not answer {task} in time")
        kind, out = conn.recv()
        if kind == "error":
            raise RuntimeError(f"client process {i} failed in {task}:\n{out}")
        return kind, out

    def close(self, timeout: float = 15.0) -> list[int | None]:
        """Ask every process to close its state and exit; terminate the ones
        that do not. Returns their exit codes. Idempotent."""
        for conn in self._conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send(None)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        codes = [proc.exitcode for proc in self._procs]
        self._conns, self._procs = [], []
        return codes
