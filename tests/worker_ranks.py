"""A TP rank of the connector's worker side in a process of its own, without
vLLM: the test sends it each step's metadata, and it runs the step's hooks on
its own KV (CPU or CUDA tensors, seeded by its rank) as vLLM's model runner
would, then answers. The leader relays its plans to the follower across the
processes (`RankRelay`), as in a real TP engine.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from sidecar_proc import DEADLINE, SPAWN
from vllm_helpers import kv_caches

from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.metadata import ConnectorMeta
from engine_shim.kvconnector.parallel import Parallel
from engine_shim.kvconnector.settings import ConnectorSettings
from engine_shim.kvconnector.worker import WorkerSide


def rank_main(
    conn: Connection,
    settings: ConnectorSettings,
    geometry: KVGeometry,
    rank: int,
    size: int,
    device: str,
) -> None:
    kv = {
        name: t.to(device=device, dtype=geometry.dtype)  # keeps the view's strides
        for name, t in kv_caches(seed=10 + rank).items()
    }
    worker = WorkerSide(settings, geometry, Parallel(rank, size))
    worker.register(kv)
    conn.send("registered")
    try:
        while True:
            command, arg = conn.recv()
            if command == "step":
                conn.send(step(worker, kv, arg))
            elif command == "finished":
                conn.send(finished(worker, arg))
            elif command == "copied":
                conn.send(copied(worker, kv, *arg))
            elif command == "close":
                break
            else:
                raise ValueError(f"unknown command {command!r}")
    finally:
        worker.close()
        conn.send("closed")


def step(worker: WorkerSide, kv: dict[str, torch.Tensor], meta: ConnectorMeta) -> str:
    """One forward's hooks, in vLLM's order (the layer hooks do nothing
    unless `layer_wise` is on)."""
    worker.start_loads(meta)
    for name in kv:
        worker.wait_for_layer(name)
        worker.save_layer(meta, name)
    worker.run_saves(meta)
    return "stepped"


def finished(worker: WorkerSide, want: tuple[set[str], set[str]]) -> tuple[set[str], set[str]]:
    """What the rank reported finished, gathered until it is `want` (or the
    deadline passes: the test then sees what it got)."""
    got: tuple[set[str], set[str]] = (set(), set())
    deadline = time.monotonic() + DEADLINE
    while got != want and time.monotonic() < deadline:
        sending, recving = worker.finished()
        got = (got[0] | sending, got[1] | recving)
        time.sleep(0.002)
    return got


def copied(
    worker: WorkerSide, kv: dict[str, torch.Tensor], source: list[int], target: list[int]
) -> tuple[bool, set[str]]:
    """Whether blocks `target` hold exactly what blocks `source` hold, in
    every layer; and the rank's load errors."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return all(torch.equal(t[target], t[source]) for t in kv.values()), worker.load_errors()


class Rank:
    """The test's end of one rank process."""

    def __init__(self, *args: Any) -> None:
        self.conn, there = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=rank_main, args=(there, *args), daemon=True)
        self.proc.start()
        there.close()

    def send(self, command: str, arg: Any = None) -> None:
        self.conn.send((command, arg))

    def answer(self) -> Any:
        assert self.conn.poll(DEADLINE), f"rank process {self.proc.pid} did not answer"
        return self.conn.recv()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.send("close")
                self.answer()
        finally:
            self.proc.join(DEADLINE)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self.conn.close()
