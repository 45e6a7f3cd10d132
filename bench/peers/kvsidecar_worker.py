"""kvsidecar's per-call rows (see bench/peers/calls.py for the protocol):
a real `kvsidecar serve` per geometry and one registered `KVClient`, driven
only through its public API (register, save/load(...).wait(), lookup,
delete), so a faster client or sidecar shows here with no change.

The CPU tier is sized to the spec's `cache_blocks` (the pre-saved set plus
one save in flight); the engine's KV cache is one fp16 tensor per layer,
[blocks, K/V, tokens, heads, head_dim] ("paged"). With spec.paired_floor,
the saves and loads of the largest transfer are paired with the memcpy
floor's in this process (bench/peers/calls.py, PairedFloor), copying in the
same memory (`SameMemoryFloor`).
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.peers.block_copy import copy_ranges
from bench.peers.calls import block_bytes, log, worker_main
from bench.peers.memcpy_worker import Floor, MemcpyFloor
from contract.ids import key_bytes
from engine_shim.client import KVClient
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar
from shm.layout import BlockLayout


class KvsidecarSystem:
    def __init__(self) -> None:
        self._sidecar: LocalSidecar | None = None
        self._client: KVClient | None = None
        self._workdir: Path | None = None
        self._tpb = 1
        self._kv: list[torch.Tensor] = []
        self._freed: np.ndarray | None = None
        self.keep_freed = False
        """Whether `forget` notes the slots it frees (for SameMemoryFloor)."""
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
        self._kv = kv
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
        if self.keep_freed:
            self._freed = self.slot_addresses(tokens)  # SameMemoryFloor's save writes there
        self.client.delete(tokens[: self._tpb])  # the first block and all extending it

    def load(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        return int(self.client.load(tokens, block_ids).wait())

    def lookup(self, tokens: np.ndarray) -> int:
        return self.client.lookup(tokens)

    def prepare_load(self, tokens: np.ndarray) -> None:
        pass

    def tidy(self) -> None:
        pass

    def slot_addresses(self, tokens: np.ndarray) -> np.ndarray | None:
        """Addresses, in this process, of the CPU-tier slots holding the
        blocks of `tokens` ready now (as the hot index says), or None where
        this client has no hot index. For the floor only: it reads the
        client's internals, outside every timed call."""
        link = self.client._link
        hot = link.hot.index
        if hot is None or link.pool is None or link.layout is None:
            return None
        slots, _ = hot.view.find(key_bytes(self.client.block_keys(tokens)))
        return link.pool.slot_addresses(slots, link.layout.slot_stride)

    def close(self) -> None:
        self._kv = []
        self._freed = None
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


class SameMemoryFloor(Floor):
    """The memcpy floor of kvsidecar's saves and loads in the memory they
    use: the same bytes copied by the same C copy as MemcpyFloor's, between
    the engine's KV tensors and the CPU tier's slots, in long runs on both
    sides (`_runs`: a whole block in the 2,048-block rows) where kvsidecar
    copies one layer's piece of a block at a time. A save's floor writes
    the slots the last save of the row used, free again since its
    `forget`; a load's reads the slots holding the blocks loaded and writes
    the engine's tensors. Buffers of one kind copied at speeds up to 1.2x
    apart in one process on these VMs, the same way round after round
    (docs/measurements.md, "The floor's memory"), so a floor between
    buffers of its own judged kvsidecar partly by where its memory lies.

    Needs the client's hot index to find the slots: where it has none,
    `available` is False and the worker pairs with MemcpyFloor instead."""

    own_buffers = False

    def __init__(self, system: KvsidecarSystem) -> None:
        self._system = system
        self._block = 0
        self._loads: dict[bytes, tuple[np.ndarray, np.ndarray, int]] = {}

    @property
    def available(self) -> bool:
        return self._system.client._link.hot.index is not None

    def open(self, geometry: dict[str, Any], kv_blocks: int, cache_blocks: int) -> None:
        """Opened right before the first row it pairs (PairedFloor): the
        system's forgets note their slots from then on, not in the rows before."""
        self._block = block_bytes(geometry)
        self._system.keep_freed = True

    def _runs(self, block_ids: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(engine addresses, slot addresses, run bytes) of the copy: each
        layer's bytes of blocks `block_ids` (consecutive ids: the rows'
        arange) and the slots' bytes, cut in runs of the largest size that
        tiles both (a whole block where the blocks tile a layer's span)."""
        n = len(block_ids)
        first = int(block_ids[0])
        if not np.array_equal(block_ids, np.arange(first, first + n)):
            raise ValueError("the same-memory floor copies consecutive engine blocks only")
        if slots.size != n:
            raise ValueError(f"{slots.size} slots for {n} blocks")
        kv = self._system._kv
        layer_bytes = self._block // len(kv)
        span = n * layer_bytes
        run = math.gcd(span, self._block)
        starts = np.array([t.data_ptr() for t in kv], dtype=np.uint64)
        starts += np.uint64(first * layer_bytes)
        steps = np.arange(span // run, dtype=np.uint64) * np.uint64(run)
        engine = (starts[:, None] + steps[None, :]).ravel()
        steps = np.arange(self._block // run, dtype=np.uint64) * np.uint64(run)
        cache = (slots[:, None] + steps[None, :]).ravel()
        return engine, cache, run

    def save(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        slots = self._system._freed
        if slots is None:
            raise RuntimeError("the same-memory floor saves after a save of the row was forgotten")
        engine, cache, run = self._runs(block_ids, slots)
        copy_ranges(engine, cache, run, save=True)
        return len(block_ids) * self._system._tpb

    def load(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        key = tokens.tobytes() + np.asarray(block_ids).tobytes()
        if key not in self._loads:  # the first call is a warm-up one (calls.timed)
            slots = self._system.slot_addresses(tokens)
            if slots is None or slots.size < len(block_ids):
                raise RuntimeError("the blocks to load are not in the CPU tier")
            self._loads[key] = self._runs(block_ids, slots[: len(block_ids)])
        engine, cache, run = self._loads[key]
        copy_ranges(cache, engine, run, save=False)
        return len(block_ids) * self._system._tpb

    def close(self) -> None:
        self._loads.clear()
        self._system.keep_freed = False


def main() -> int:
    from importlib.metadata import version

    system = KvsidecarSystem()

    def floor() -> SameMemoryFloor | MemcpyFloor:
        same = SameMemoryFloor(system)
        if same.available:
            return same
        log("no hot index: the floor copies between buffers of its own")
        return MemcpyFloor()

    code = worker_main(
        lambda _: system, "kvsidecar " + version("kvsidecar"), "kvsidecar", make_floor=floor
    )
    for problem in system.problems:
        print(problem, file=sys.stderr)
    return 1 if system.problems else code


if __name__ == "__main__":
    sys.exit(main())
