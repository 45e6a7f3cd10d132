"""kvsidecar's per-call rows (see bench/peers/calls.py for the protocol):
a real `kvsidecar serve` per geometry and one registered `KVClient`, driven
only through its public API (register, save/load(...).wait(), lookup,
delete), so a faster client or sidecar shows here with no change.

The CPU tier is sized to the spec's `cache_blocks` (the pre-saved set plus
one save in flight); the engine's KV cache is one fp16 tensor per layer,
[blocks, K/V, tokens, heads, head_dim] ("paged"). With spec.paired_floor,
the saves and loads of the largest transfer are paired with the memcpy
floor's in this process (bench/peers/calls.py, PairedFloor).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.peers.calls import block_bytes, worker_main
from bench.peers.memcpy_worker import MemcpyFloor
from engine_shim.client import KVClient
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar
from shm.layout import BlockLayout


class KvsidecarSystem:
    def __init__(self) -> None:
        self._sidecar: LocalSidecar | None = None
        self._client: KVClient | None = None
        self._workdir: Path | None = None
        self._tpb = 1
        self.problems: list[str] = []

    def open(self, geometry: dict[str, Any], kv_blocks: int, cache_blocks: int) -> None:
        g = geometry
        self._tpb = g["tokens_per_block"]
        layer_bytes = block_bytes(g) // g["num_layers"]
        stride = BlockLayout(num_layers=g["num_layers"], layer_block_bytes=layer_bytes).slot_stride
        self._workdir = Path(tempfile.mkdtemp(prefix="kvsbench-calls-"))
        self._sidecar = LocalSidecar(
            self._workdir,
            cpu_capacity=str(cache_blocks * stride),
            settings=BENCH_SIDECAR_SETTINGS,
            tag="calls",
        ).start()
        shape = (kv_blocks, 2, self._tpb, g["num_kv_heads"], g["head_dim"])
        kv = [torch.ones(shape, dtype=torch.float16) for _ in range(g["num_layers"])]
        self._client = KVClient.connect(self._sidecar.endpoint, timeout=60.0)
        self._client.register(
            kv,
            model_name="bench-calls",
            model_revision="0",
            tokens_per_block=self._tpb,
            num_kv_heads=g["num_kv_heads"],
            head_dim=g["head_dim"],
        )

    @property
    def client(self) -> KVClient:
        if self._client is None:
            raise RuntimeError("not open")
        return self._client

    def save(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        return int(self.client.save(tokens, block_ids).wait())

    def forget(self, tokens: np.ndarray) -> None:
        self.client.delete(tokens[: self._tpb])  # the first block and all extending it

    def load(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        return int(self.client.load(tokens, block_ids).wait())

    def lookup(self, tokens: np.ndarray) -> int:
        return self.client.lookup(tokens)

    def prepare_load(self, tokens: np.ndarray) -> None:
        pass

    def tidy(self) -> None:
        pass

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._sidecar is not None:
            shutdown = self._sidecar.close()
            if shutdown.exit_code != 0 or shutdown.leftovers:
                self.problems.append(
                    f"the sidecar exited with {shutdown.exit_code} and left "
                    f"{len(shutdown.leftovers)} shm segment(s): {self._sidecar.log_tail()}"
                )
            self._sidecar = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def main() -> int:
    from importlib.metadata import version

    system = KvsidecarSystem()
    code = worker_main(
        lambda _: system, "kvsidecar " + version("kvsidecar"), "kvsidecar", make_floor=MemcpyFloor
    )
    for problem in system.problems:
        print(problem, file=sys.stderr)
    return 1 if system.problems else code


if __name__ == "__main__":
    sys.exit(main())
