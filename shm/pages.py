"""What backs a pool's memory: the filesystem of its files, the pages its mappings got.

A directory pool must be on a memory filesystem, tmpfs or hugetlbfs: a shared
mapping of a file on a disk filesystem is written back to the disk. They are
told apart by statfs's f_type (os.statvfs does not return it).

What a mapping actually got is read from /proc/self/smaps, the kernel's own
account of each mapping, rather than guessed from mount options:
- KernelPageSize above 4 kB: hugetlbfs pages ("hugetlbfs");
- "THPeligible: 1": shmem that may be backed by transparent huge pages (a
  tmpfs mounted huge=always or within_size, or shmem_enabled forcing it):
  "thp"; ShmemPmdMapped counts the bytes that are huge pages right now, so it
  is only complete once every page has been faulted in (a prefaulted pool);
- anything else: "4k".
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
PAGE_KINDS = ("4k", "thp", "hugetlbfs")
_THP_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
_HUGEPAGES = Path("/sys/kernel/mm/hugepages")
_VMA = re.compile(rb"([0-9a-f]+)-([0-9a-f]+) ")


class _StatFs(ctypes.Structure):
    # struct statfs on 64-bit Linux starts with f_type and f_bsize (longs);
    # the rest (at most 104 bytes) is not read here.
    _fields_ = [
        ("f_type", ctypes.c_long),
        ("f_bsize", ctypes.c_long),
        ("rest", ctypes.c_byte * 240),
    ]


_libc = ctypes.CDLL(None, use_errno=True)


class Backing(NamedTuple):
    """The memory filesystem a directory pool lives on."""

    fs: str
    """"tmpfs" or "hugetlbfs"."""
    page_bytes: int
    """Segment sizes are a multiple of this, so every byte can be a huge page:
    the hugetlbfs page size, or for tmpfs the transparent huge page size."""


class PageReport(NamedTuple):
    kind: str
    """One of PAGE_KINDS; "unknown" where /proc/self/smaps cannot be read."""
    huge_bytes: int
    """Bytes of the mappings that are huge pages now (see the module docstring)."""


def statfs(fd: int) -> tuple[int, int]:
    """(f_type, f_bsize) of the filesystem of an open file or directory."""
    buf = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.f_type & 0xFFFFFFFF, int(buf.f_bsize)


def backing_of(fd: int) -> Backing | None:
    """The memory filesystem of an open file or directory; None for any other."""
    magic, block = statfs(fd)
    if magic == HUGETLBFS_MAGIC:
        return Backing("hugetlbfs", block)
    if magic == TMPFS_MAGIC:
        return Backing("tmpfs", thp_bytes())
    return None


def thp_bytes() -> int:
    """The transparent huge page (PMD) size; 2 MiB where the kernel does not say."""
    try:
        return int(_THP_PMD_SIZE.read_text())
    except (OSError, ValueError):
        return 2 << 20


def hugetlb_pages_free(page_bytes: int) -> int:
    """Huge pages of this size a new mapping can still get: free and not
    reserved, plus what overcommit allows. 0 if the kernel has none of that size."""
    pool = _HUGEPAGES / f"hugepages-{page_bytes // 1024}kB"

    def read(name: str) -> int:
        try:
            return int((pool / name).read_text())
        except (OSError, ValueError):
            return 0

    overcommit = max(0, read("nr_overcommit_hugepages") - read("surplus_hugepages"))
    return max(0, read("free_hugepages") - read("resv_hugepages")) + overcommit


def page_report(spans: Sequence[tuple[int, int]]) -> PageReport:
    """What backs the mappings at (address, size) in this process, from smaps."""
    try:
        smaps = Path("/proc/self/smaps").read_bytes()
    except OSError:
        return PageReport("unknown", 0)
    page_kib, eligible, seen = 0, False, False
    sums = dict.fromkeys((b"ShmemPmdMapped", b"Shared_Hugetlb", b"Private_Hugetlb"), 0)
    inside = False
    for line in smaps.splitlines():
        vma = _VMA.match(line)
        if vma is not None:
            lo, hi = int(vma[1], 16), int(vma[2], 16)
            inside = any(start <= lo and hi <= start + size for start, size in spans)
            seen = seen or inside
            continue
        if not inside:
            continue
        key, _, value = line.partition(b":")
        if key == b"THPeligible":
            eligible = eligible or value.strip() == b"1"
        elif key == b"KernelPageSize":
            page_kib = max(page_kib, _kib(value))
        elif key in sums:
            sums[key] += _kib(value)
    if not seen:
        return PageReport("unknown", 0)
    if page_kib > 4:
        return PageReport("hugetlbfs", (sums[b"Shared_Hugetlb"] + sums[b"Private_Hugetlb"]) << 10)
    return PageReport("thp" if eligible else "4k", sums[b"ShmemPmdMapped"] << 10)


def _kib(value: bytes) -> int:
    """The number in an smaps value such as b"  2048 kB"."""
    try:
        return int(value.split()[0])
    except (IndexError, ValueError):
        return 0
