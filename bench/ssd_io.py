"""The SSD tier and its raw O_DIRECT floor, driven alike for `bench ssd`.

Both move a batch of n blocks between shm slots and a file in the benchmark's
directory. A batch is split as `DataPlane._jobs` splits an op: parts of
ceil(n / threads) consecutive blocks, one job each on an `IoPool` of
`threads` threads, the caller waiting on the pool's eventfd as the sidecar's
loop does. Only what a job does differs:
- tier: `SsdStore.write_run` / `read_run`, as the sidecar calls them (a
  thread's blocks written `write_depth` at a time through Linux AIO, each
  hashed while its write is in flight, a journal record before and after;
  a key check and an xxh3 checksum of each block read, the next block's
  read in flight meanwhile);
- floor: O_DIRECT writes and reads of the same blocks on the tier's own
  data file (block i at i * slot_bytes, as the tier puts it), issued as the
  tier issues them: writes `write_depth` at a time through Linux AIO (one
  `pwritev` a block where the tier has no AIO), reads one `preadv` a block;
- per-block floor (writes only): one synchronous `os.pwritev` a block, the
  floor before the tier's writes went through AIO, reported beside it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.ssd.store import (
    MAGIC,
    RECORD,
    RECORD_BYTES,
    VALID,
    ReadBlock,
    SsdStore,
    WriteBlock,
    aio_queue,
    read_header,
)

Job = Callable[[int, int], None]
"""Moves blocks lo..hi-1 of a batch."""


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "little")


def run_batch(io: IoPool, n: int, job: Job) -> None:
    """Run `job` over blocks 0..n-1 in parts across the pool's threads and wait
    for every part; re-raises the first error."""
    step = max(1, -(-n // io.threads))
    parts = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    for lo, hi in parts:
        io.submit(None, lambda lo=lo, hi=hi: job(lo, hi))
    left, errors = len(parts), []
    while left:
        select.select([io.fd], [], [])
        for done in io.collect():
            left -= 1
            if done.error is not None:
                errors.append(done.error)
    if errors:
        raise errors[0]


class Tier:
    """An `SsdStore` of `nslots` slots in `directory`, one block per slot."""

    def __init__(self, directory: Path, slot_bytes: int, nslots: int) -> None:
        self.store = SsdStore([str(directory)], nslots * slot_bytes, slot_bytes, slot_bytes, "kvsb")
        self.direct = self.store.direct
        self.data_path = directory / "kvsb.data"
        self.slot_bytes = slot_bytes

    @property
    def depth(self) -> int | None:
        """Writes a thread has in flight, when they go through Linux AIO."""
        return self.store.write_depth

    def writer(self, src: list[memoryview]) -> Job:
        def write(lo: int, hi: int) -> None:
            self.store.write_run(
                [
                    WriteBlock(i, src[i], key(i), key(i - 1) if i else b"\0" * 16, i == 0)
                    for i in range(lo, hi)
                ]
            )

        return write

    def reader(self, dst: list[memoryview]) -> Job:
        def read(lo: int, hi: int) -> None:
            ok = self.store.read_run([ReadBlock(i, dst[i], key(i)) for i in range(lo, hi)])
            if not all(ok):
                bad = lo + ok.index(False)
                raise RuntimeError(f"block {bad} failed its checksum: the benchmark is broken")

        return read

    def close(self) -> None:
        self.store.close()


class Floor:
    """A file of at least `nslots` slots, preallocated (an existing one is
    left as it is), opened with O_DIRECT. Writing block i's bytes at slot i
    of a tier's data file leaves the tier's records true. With `depth`, a
    thread's writes go as the tier's do through Linux AIO: `depth` blocks
    submitted, then reaped, then the next ones; without it, one `pwritev` a
    block."""

    def __init__(self, path: Path, slot_bytes: int, nslots: int, depth: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.slot_bytes = slot_bytes
        self.depth = depth
        flags = os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC
        self.fd = os.open(self.path, flags, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, nslots * slot_bytes)
        except OSError:
            os.close(self.fd)
            raise

    def writer(self, src: list[memoryview]) -> Job:
        depth = self.depth

        def write(lo: int, hi: int) -> None:
            if depth is None:
                for i in range(lo, hi):
                    _whole(os.pwritev(self.fd, [src[i]], i * self.slot_bytes), len(src[i]))
                return
            queue = aio_queue()
            try:
                for start in range(lo, hi, depth):
                    group = range(start, min(hi, start + depth))
                    for i in group:
                        queue.submit(self.fd, src[i], i * self.slot_bytes, True)
                    for _, done in queue.wait(len(group)):
                        _whole(done, self.slot_bytes)
            finally:
                if queue.pending:  # an error: nothing left in flight for the queue's next user
                    queue.wait(queue.pending)

        return write

    def reader(self, dst: list[memoryview]) -> Job:
        def read(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                _whole(os.preadv(self.fd, [dst[i]], i * self.slot_bytes), len(dst[i]))

        return read

    def close(self) -> None:
        os.close(self.fd)


class StoredSlots:
    """Raw O_DIRECT reads of the slots of an SSD tier's data file that hold
    blocks (its journal's valid records, one directory): the floor of a GET
    served from that file."""

    def __init__(self, data_path: Path) -> None:
        header = read_header(data_path.with_suffix(".json"))
        if header is None:
            raise RuntimeError(f"{data_path}: no readable header")
        journal = data_path.with_suffix(".journal").read_bytes()
        self.slots = [
            j
            for j in range(len(journal) // RECORD_BYTES)
            if _valid(RECORD.unpack_from(journal, j * RECORD_BYTES))
        ]
        self.slot_bytes = int(header["slot_bytes"])
        self.fd = os.open(data_path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)

    def reader(self, dst: list[memoryview]) -> Job:
        """Reads slot k of the stored ones into dst[k]."""
        if len(dst) > len(self.slots):
            raise ValueError(f"{len(dst)} buffers for {len(self.slots)} stored blocks")

        def read(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                _whole(os.preadv(self.fd, [dst[i]], self.slots[i] * self.slot_bytes), len(dst[i]))

        return read

    def close(self) -> None:
        os.close(self.fd)


def _valid(record: tuple) -> bool:
    magic, flags = record[0], record[1]
    return magic == MAGIC and bool(flags & VALID)


def _whole(done: int, nbytes: int) -> None:
    # O_DIRECT transfers of whole aligned blocks are never short on a local
    # filesystem; if one is, the floor is not what it claims to be.
    if done != nbytes:
        raise OSError(errno.EIO, f"short transfer: {done} of {nbytes} bytes")


def drop_page_cache() -> bool:
    """Drop the page cache (root only); whether it was."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fio_rates(path: Path, block: int, n: int, threads: int) -> dict[str, Any]:
    """fio's GB/s for the floor's transfer (sequential O_DIRECT, psync, one
    job per thread, each over its share of the n blocks), or why there is none.
    fio reads into its own malloc'd buffers: scattered 4 KiB pages, which on a
    virtio disk cost it more than half its read rate against huge pages."""
    fio = shutil.which("fio")
    if fio is None:
        return {"available": False, "note": "fio is not on PATH"}
    per_job = -(-n // threads) * block
    out: dict[str, Any] = {"available": True, "buffers": "fio's own (malloc, 4 KiB pages)"}
    for rw in ("write", "read"):
        cmd = [
            fio, "--name=kvsbench", f"--filename={path}", f"--rw={rw}", f"--bs={block}",
            f"--size={per_job}", f"--offset_increment={per_job}", f"--numjobs={threads}",
            "--direct=1", "--ioengine=psync", "--group_reporting", "--output-format=json",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return {"available": True, "error": done.stderr.strip()[-500:]}
        with contextlib.suppress(ValueError, KeyError, IndexError):
            job = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]
            out[f"{rw}_gbps"] = job[rw]["bw_bytes"] / 1e9
    return out
