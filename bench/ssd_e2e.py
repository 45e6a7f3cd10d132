"""`bench ssd` end to end: a GET whose blocks all come from SSD, through a real sidecar.

A `kvsidecar serve` subprocess with an SSD directory and a CPU tier a little
larger than the batch; an engine (a KVClient over CPU tensors: 16 layers of
block_bytes / 16 each) saves n blocks, write_through puts them on SSD, and
once every write has landed the sidecar is restarted: its CPU tier starts
empty and its SSD index is recovered from the journal. Then, per repeat
(each after a fresh restart, the page cache dropped when permitted):
register, load an unrelated 1-block prefix untimed (starts the I/O threads),
and time `client.load(tokens, ids).wait()` of the n blocks: the sidecar
stages them SSD -> shm on its I/O pool, answers, the engine copies shm ->
its tensors and acknowledges. The loaded bytes are checked.

The floor is taken next to each GET (before it in odd repeats, after it in
even ones), since the disk drifts; the ratio is the median over repeats of
a GET's rate against its own repeat's floor (`vs_floor`). The floor: raw
O_DIRECT reads of n blocks from the slots that hold them in the sidecar's
own SSD data file (its journal says which) into the sidecar's own CPU-tier
memory (mapped here as an engine maps it, every page populated), with its
thread count and split (`bench.ssd_io`). The same memory matters: O_DIRECT into 4 KiB pages
runs at half speed when they are physically scattered (a 2 MiB block of
~200 runs of pages against ~20), and a pool created right after another was
freed often is; `phys_runs_per_block` says how scattered it was.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.hugepages import physical_runs
from bench.ssd_io import StoredSlots, drop_page_cache, run_batch
from bench.ssd_report import paired_ratio
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar
from shm.names import SHM_DIR
from shm.pool import ShmPool
from sidecar.tiers.io_pool import IoPool

LAYERS = 16
TOKENS_PER_BLOCK = 16
HEADS = 8
UNIT_BYTES = 2 * TOKENS_PER_BLOCK * HEADS * 4  # K and V of one head_dim step, fp32, per layer


def check_block_bytes(block_bytes: int) -> None:
    if block_bytes % (LAYERS * UNIT_BYTES):
        raise ValueError(f"end-to-end blocks must be a multiple of {LAYERS * UNIT_BYTES} bytes")


def measure_get(
    workdir: Path, ssd_dir: Path, block_bytes: int, n: int, repeats: int, threads: int
) -> dict:
    """GB/s of a GET of n blocks of `block_bytes`, all from SSD, and of the
    floor next to it: medians over repeats; `vs_floor` the median of each
    repeat's ratio (its GET against its own floor)."""
    bench = _GetBench(workdir, ssd_dir, block_bytes, n, threads)
    try:
        bench.save()
        for repeat in range(repeats):
            bench.repeat(floor_first=bool(repeat % 2))
    finally:
        code, left = bench.close()
    if code != 0 or left:
        raise RuntimeError(f"the sidecar exited {code}, left {left}: {bench.sidecar.log_tail()}")
    size = n * block_bytes
    gbps = size / float(np.median(bench.seconds)) / 1e9
    floor_gbps = size / float(np.median(bench.floor_seconds)) / 1e9
    return {
        "blocks": n,
        "block_bytes": block_bytes,
        "bytes": size,
        "seconds": bench.seconds,
        "floor_seconds": bench.floor_seconds,
        "gbps": gbps,
        "floor_read_gbps": floor_gbps,
        "vs_floor": paired_ratio(bench.floor_seconds, bench.seconds),
        "phys_runs_per_block": bench.runs,
        "page_cache_dropped": all(bench.dropped),
    }


class _GetBench:
    def __init__(self, workdir: Path, ssd_dir: Path, block_bytes: int, n: int, threads: int):
        import torch

        check_block_bytes(block_bytes)
        self.n, self.block_bytes = n, block_bytes
        head_dim = block_bytes // (LAYERS * UNIT_BYTES)
        shape = (2 * n + 1, 2, TOKENS_PER_BLOCK, HEADS, head_dim)
        g = torch.Generator().manual_seed(n)
        self.kv = [torch.randn(shape, generator=g) for _ in range(LAYERS)]
        self.model = {
            "model_name": "bench-ssd",
            "model_revision": "r1",
            "tokens_per_block": TOKENS_PER_BLOCK,
            "num_kv_heads": HEADS,
            "head_dim": head_dim,
        }
        self.tokens = np.arange(n * TOKENS_PER_BLOCK, dtype=np.int64)
        self.other = np.arange(TOKENS_PER_BLOCK, dtype=np.int64) + 50_000  # 1-block warm-up
        cpu_mib = -(-(n + 1) * block_bytes * 5 // 4 // (1 << 20))
        self.sidecar = LocalSidecar(
            workdir,
            cpu_capacity=f"{cpu_mib}MiB",
            settings=BENCH_SIDECAR_SETTINGS,
            tag="bench",
        )
        self.sidecar.args += [
            "--set", f"ssd_dirs={ssd_dir}",
            "--set", f"ssd_capacity_per_dir={(n + 8) * block_bytes}",
            "--set", "write_policy=write_through",
            "--set", f"ssd_io_threads={threads}",
        ]  # fmt: skip
        self.ssd_dir = ssd_dir
        self.io = IoPool("bench-e2e", threads)
        self.floor: StoredSlots | None = None
        self.seconds: list[float] = []
        self.floor_seconds: list[float] = []
        self.runs: list[float | None] = []
        self.dropped: list[bool] = []

    def save(self) -> None:
        """The n blocks and the warm-up block, on SSD."""
        with _client(self.sidecar.start().endpoint, self.kv, self.model) as client:
            client.save(self.tokens, np.arange(self.n)).wait()
            client.save(self.other, np.array([2 * self.n])).wait()
            _wait_on_ssd(client, self.n + 1)
        # The geometry's data file (`SsdSpace` names it after the instance
        # and the layout); the floor reads the slots its journal says hold blocks.
        files = list(self.ssd_dir.glob(f"kvsidecar-{self.sidecar.instance}-*.data"))
        if len(files) != 1:
            raise RuntimeError(f"expected one SSD data file, found {files}")
        self.floor = StoredSlots(files[0])
        if len(self.floor.slots) != self.n + 1:
            raise RuntimeError(f"{len(self.floor.slots)} blocks on SSD, saved {self.n + 1}")

    def repeat(self, floor_first: bool) -> None:
        n = self.n
        if self.sidecar.stop() != 0:
            raise RuntimeError(f"the sidecar did not stop cleanly: {self.sidecar.log_tail()}")
        self.dropped.append(drop_page_cache())
        with _client(self.sidecar.start().endpoint, self.kv, self.model) as client:
            if client.stats()["tiers"]["cpu"]["used_blocks"]:
                raise RuntimeError("the CPU tier is not empty after a restart")
            client.load(self.other, np.array([2 * n])).wait()
            if floor_first:
                self._floor()
            start = time.perf_counter()
            loaded = client.load(self.tokens, np.arange(n, 2 * n)).wait()
            self.seconds.append(time.perf_counter() - start)
            staged = client.stats()["tiers"]["cpu"]["used_blocks"]
            if loaded != len(self.tokens) or staged != n + 1:
                raise RuntimeError(f"loaded {loaded} tokens, {staged} CPU blocks: not from SSD")
            for layer in self.kv[:: LAYERS // 4]:
                if not np.array_equal(layer[n : 2 * n].numpy(), layer[:n].numpy()):
                    raise RuntimeError("loaded blocks differ from the saved ones")
                layer[n : 2 * n] = 0
            if not floor_first:
                self._floor()

    def _floor(self) -> None:
        """Raw reads of n blocks into CPU-tier slots 1..n of the running sidecar:
        the memory its GET stages into (the warm-up block holds one slot)."""
        assert self.floor is not None
        prefix = self.sidecar.shm_prefix + "."
        names = sorted(
            (e for e in os.listdir(SHM_DIR) if e.startswith(prefix)),
            key=lambda e: int(e[len(prefix) :]),
        )
        sizes = [os.stat(SHM_DIR / e).st_size for e in names]
        with ShmPool.attach(["/" + e for e in names], sizes) as pool:
            pool.populate()
            slots = range(1, self.n + 1)
            dst = [memoryview(pool.slot_view(i, self.block_bytes)) for i in slots]
            start = time.perf_counter()
            run_batch(self.io, self.n, self.floor.reader(dst))
            self.floor_seconds.append(time.perf_counter() - start)
            for view in dst:
                view.release()
            self.runs.append(physical_runs(pool, self.block_bytes, slots))

    def close(self) -> tuple[int | None, list[str]]:
        """Stop the sidecar and release everything; (its exit code, shm it left)."""
        code = self.sidecar.stop()
        left = self.sidecar.remove_leftovers()
        if self.floor is not None:
            self.floor.close()
        self.io.close()
        return code, left


def _client(endpoint: str, kv: list, model: dict[str, Any]) -> Any:
    from engine_shim import KVClient

    client = KVClient.connect(endpoint, timeout=30.0)
    client.register(kv, **model)
    return client


def _wait_on_ssd(client: Any, n: int, timeout: float = 120.0) -> None:
    """Until n blocks are on SSD and no write is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["tiers"]["ssd"]["cached_blocks"] >= n and stats["plans_in_flight"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"blocks did not reach SSD in {timeout:.0f} s: {stats['tiers']}")
        time.sleep(0.02)
