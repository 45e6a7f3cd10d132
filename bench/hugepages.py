"""Temporary huge-page mounts for benchmarks and tests, and how contiguous a pool is.

`thp_tmpfs` mounts a private tmpfs with huge=always; `hugetlbfs` reserves
huge pages (/proc/sys/vm/nr_hugepages) and mounts a hugetlbfs limited to
them. Both need root, and both are undone on exit: unmounted, the mount
point removed, the reservation given back. Whatever cannot be had raises
HugePagesUnavailable with the reason, for the caller to report or skip on.
Close every pool in the mount before leaving the block.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shm.layout import PAGE_BYTES
from shm.pages import thp_bytes
from shm.pool import ShmPool

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGETLB_PAGE = 2 << 20


class HugePagesUnavailable(RuntimeError):
    """No huge-page mount can be made here (not root, no kernel support, no pages)."""


@contextlib.contextmanager
def thp_tmpfs(nbytes: int, parent: str = "/tmp") -> Iterator[str]:
    """A tmpfs of at least `nbytes` mounted huge=always; yields its path."""
    size = -(-nbytes // thp_bytes()) * thp_bytes()
    with _mounted(parent, "thp", ["-t", "tmpfs", "-o", f"huge=always,size={size},mode=0700"]) as d:
        yield d


@contextlib.contextmanager
def hugetlbfs(nbytes: int, parent: str = "/tmp") -> Iterator[str]:
    """A hugetlbfs of 2 MiB pages holding `nbytes`, with that many pages
    reserved for the duration; yields its path."""
    pages = -(-nbytes // HUGETLB_PAGE)
    if os.geteuid() != 0:
        raise HugePagesUnavailable("reserving huge pages needs root")
    with open(NR_HUGEPAGES) as lock:
        # Held while the reservation is changed and used, so that parallel
        # test workers never undo each other's; no lock file is left behind.
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = _nr_hugepages()
        _set_nr_hugepages(before + pages)
        added = _nr_hugepages() - before
        try:
            if added < pages:
                raise HugePagesUnavailable(
                    f"only {added} of {pages} huge pages of 2 MiB could be reserved"
                )
            options = f"pagesize=2M,size={pages * HUGETLB_PAGE},mode=0700"
            with _mounted(parent, "hugetlbfs", ["-t", "hugetlbfs", "-o", options]) as d:
                yield d
        finally:
            # Pages still mapped somewhere become surplus, freed with the last mapping.
            _set_nr_hugepages(max(0, _nr_hugepages() - added))


@contextlib.contextmanager
def _mounted(parent: str, tag: str, args: list[str]) -> Iterator[str]:
    if os.geteuid() != 0:
        raise HugePagesUnavailable("mounting needs root")
    where = tempfile.mkdtemp(prefix=f"kvs-{tag}-", dir=parent)
    done = subprocess.run(["mount", *args, "none", where], capture_output=True, text=True)
    if done.returncode != 0:
        os.rmdir(where)
        raise HugePagesUnavailable(f"mount {' '.join(args)} failed: {done.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", where], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", where], capture_output=True)  # still mapped: detach
        os.rmdir(where)


def _nr_hugepages() -> int:
    return int(NR_HUGEPAGES.read_text())


def _set_nr_hugepages(n: int) -> None:
    try:
        NR_HUGEPAGES.write_text(f"{n}\n")
    except OSError as exc:
        raise HugePagesUnavailable(f"cannot write {NR_HUGEPAGES}: {exc}") from exc


def physical_runs(pool: ShmPool, stride: int, slots: range) -> float | None:
    """Mean number of physically contiguous runs of pages per slot: what the
    block layer makes into DMA segments (a virtio disk takes at most
    /sys/block/*/queue/max_segments of them per request). None unless root
    (/proc/self/pagemap hides frame numbers otherwise). Populate the pool
    first: pages not mapped in this process have no frame number here."""
    addresses = pool.slot_addresses(np.array(slots, dtype=np.int64), stride)
    pages = stride // PAGE_BYTES
    runs = []
    with open("/proc/self/pagemap", "rb") as f:
        for address in addresses.tolist():
            f.seek(address // PAGE_BYTES * 8)
            entries = np.frombuffer(f.read(pages * 8), dtype=np.uint64)
            frames = (entries & np.uint64((1 << 55) - 1)).astype(np.int64)
            if not frames.all():
                return None
            runs.append(int((np.diff(frames) != 1).sum()) + 1)
    return float(np.mean(runs)) if runs else None
