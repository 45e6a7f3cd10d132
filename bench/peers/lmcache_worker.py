"""LMCache's multiprocess server (`lmcache==0.5.6`, its side environment)
behind `bench control`'s per-call rows; see bench/peers/calls.py for the
protocol. Run as `python -m bench.peers.lmcache_worker` with the project's
root on sys.path.

Per geometry it starts `python -m lmcache.v1.multiprocess.server` (ZeroMQ
over tcp on localhost; L1 in a POSIX shm segment, --shm-name, of the spec's
cache size; LRU; --chunk-size = the block's tokens, so one chunk is one
block and the rows move the same bytes as the others') and drives it as
vLLM's LMCache MP connector does, through LMCache's own adapters
(lmcache.integration.vllm.vllm_multi_process_adapter), which need no vLLM:
- save: LMCacheMPWorkerAdapter.submit_store_request, then its future's
  result (engine-driven transfer: the worker copies the blocks into the
  server's shm with LMCache's own CPU copy, then the server commits);
- load: submit_retrieve_request, then its future's result (after an
  untimed lookup, which vLLM's scheduler always makes first: it locks the
  chunks the retrieve reads; the lookup rows time that part);
- lookup: LMCacheMPSchedulerAdapter.maybe_submit_lookup_request, then
  check_lookup_result until it answers (the lookup's read locks and session
  are released untimed after each call, as the connector does when a
  request finishes);
- a saved prefix is forgotten with reset_cache (a CLEAR of the idle cache),
  untimed: nothing else is cached while the save rows run.
The engine's KV cache is one tensor per layer in vLLM's CPU layout,
[K/V, blocks, tokens, heads, head_dim].
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import subprocess
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from bench.peers.calls import block_bytes, worker_main

SERVER_START_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LmcacheSystem:
    def __init__(self, workdir: str) -> None:
        self._workdir = Path(workdir)
        self._server: subprocess.Popen[bytes] | None = None
        self._sched: Any = None
        self._worker: Any = None
        self._ids = itertools.count()
        self._tpb = 1
        self._log: Path | None = None
        self._held: list[tuple[str, list[int], int]] = []
        """(request id, tokens, hit tokens) of lookups whose locks and session
        `tidy` releases."""

    def open(self, geometry: dict[str, Any], kv_blocks: int, cache_blocks: int) -> None:
        from lmcache.integration.vllm.vllm_multi_process_adapter import (
            LMCacheMPSchedulerAdapter,
            LMCacheMPWorkerAdapter,
            ParallelStrategy,
        )

        g = geometry
        self._tpb = g["tokens_per_block"]
        size_gb = cache_blocks * block_bytes(g) / 2**30
        port = free_port()
        self._log = self._workdir / f"lmcache-server-{port}.log"
        command = [
            sys.executable, "-m", "lmcache.v1.multiprocess.server",
            "--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(self._tpb),
            "--l1-size-gb", f"{size_gb:.4f}", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto",
            "--shm-name", f"kvsbench_lmcache_{uuid.uuid4().hex[:8]}",
            "--disable-observability",
        ]  # fmt: skip
        with self._log.open("wb") as log:
            # cwd "/": nothing of the caller's directory shadows its imports
            self._server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        url = f"tcp://127.0.0.1:{port}"
        ctx = zmq.Context.instance()
        strategy = ParallelStrategy(
            mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
        )
        deadline = time.monotonic() + SERVER_START_S
        while self._sched is None:
            if self._server.poll() is not None:
                raise RuntimeError(f"the LMCache server exited: {self._log_tail()}")
            try:
                self._sched = LMCacheMPSchedulerAdapter(
                    [url], ctx, "bench-calls", self._tpb, strategy, mq_timeout=5.0
                )
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
        self._worker = LMCacheMPWorkerAdapter(
            url, ctx, "bench-calls", self._tpb, strategy, mq_timeout=60.0
        )
        shape = (2, kv_blocks, self._tpb, g["num_kv_heads"], g["head_dim"])
        kv = {
            f"model.layers.{i}.self_attn": torch.ones(shape, dtype=torch.float16)
            for i in range(g["num_layers"])
        }
        self._worker.register_kv_caches(kv)

    def _log_tail(self) -> str:
        try:
            return self._log.read_text()[-2000:] if self._log else ""
        except OSError:
            return ""

    def _op(self, tokens: np.ndarray, block_ids: np.ndarray) -> Any:
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        ids = [int(b) for b in block_ids]
        return LoadStoreOp(token_ids=tokens.tolist(), block_ids=[ids], start=0, end=len(tokens))

    def save(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        rid = f"s{next(self._ids)}"
        self._worker.submit_store_request(rid, self._op(tokens, block_ids), None)
        ok = self._worker.store_futures.pop(rid).result(60.0)
        return len(tokens) if ok else 0

    def forget(self, tokens: np.ndarray) -> None:
        if not self._sched.reset_cache():
            raise RuntimeError("LMCache's CLEAR failed")

    def prepare_load(self, tokens: np.ndarray) -> None:
        """vLLM's scheduler looks a request up (which locks the chunks it
        will read) before the worker retrieves them; untimed here, the
        lookup rows time it."""
        if self.lookup(tokens) != len(tokens):
            raise RuntimeError("LMCache's lookup before a load missed")

    def load(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        rid = f"l{next(self._ids)}"
        self._worker.submit_retrieve_request(rid, self._op(tokens, block_ids), None)
        future, _ = self._worker.retrieve_futures.pop(rid)
        ok = future.result(60.0)
        return len(tokens) if ok else 0

    def lookup(self, tokens: np.ndarray) -> int:
        rid = f"q{next(self._ids)}"
        token_list = tokens.tolist()
        self._sched.maybe_submit_lookup_request(rid, token_list)
        while (hit := self._sched.check_lookup_result(rid)) is None:
            pass
        self._held.append((rid, token_list, hit))
        return int(hit)

    def tidy(self) -> None:
        """What the connector does once a request is done: release the
        lookup's read locks and end its session."""
        for rid, token_list, hit in self._held:
            if hit:
                self._sched.free_lookup_locks(token_list, 0, hit, rid)
            self._sched.end_session(rid)
            self._sched.cleanup_lookup_result(rid)
        self._held.clear()

    def close(self) -> None:
        for part in (self._worker, self._sched):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.shutdown()
        self._worker = self._sched = None
        if self._server is not None:
            self._server.terminate()
            try:
                self._server.wait(30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait(10)
            self._server = None


def main() -> int:
    return worker_main(lambda spec: LmcacheSystem(spec.workdir), version_of(), "lmcache")


def version_of() -> str:
    return "lmcache " + version("lmcache")


if __name__ == "__main__":
    sys.exit(main())
