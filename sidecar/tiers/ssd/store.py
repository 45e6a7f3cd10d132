"""The SSD tier's storage: block slots in preallocated files, a journal, checksums.

Each directory holds one data file of fixed-size slots (one block: all
layers, all TP shards) and a journal of one 64-byte record per slot, mapped
into memory: a record is written with a 64-byte store, not a system call
(two pwrite()s a block, each taking the journal's inode lock, cost the
tier's writers ~10 us a block: 10-15% of a 256 KiB O_DIRECT write here;
docs/measurements.md). The kernel writes the dirty records back; a clean
close flushes them. Slots
are striped across directories: slot s lives in directory s % n at offset
(s // n) * slot_bytes. Data moves with O_DIRECT straight between the file
and the shm slot (page-aligned, a multiple of 4 KiB): no bounce copy. A
writing thread keeps WRITE_BYTES of writes in flight through Linux AIO and
hashes those blocks meanwhile (`write_run`); a reading thread keeps the
next block's read in flight while it checks one (`read_run`).

Integrity: a slot's record holds its block key, its parent key and an xxh3
checksum of the block seeded by its key. Every read is verified; a mismatch
is a miss and the slot is dropped, so corrupted bytes never reach an engine.
Writes invalidate the record first, then write the data, then the record, so
a crash mid-write leaves a slot that fails its checksum, never one that reads
as valid with wrong bytes.

Recovery: a sidecar started again on the same directories reads the
journals back (`records`) and rebuilds the SSD index from the chains of
(key, parent key) they describe; each record's namespace tag and write time
give the trees back to their namespaces as those register
(`TieredCache.claim_recovered`). Each directory's header (`<tag>.json`)
keeps its slot count: a restart asking for the same capacity keeps it (and
every block) whatever the free space says now; another capacity refits the
files and keeps the blocks in slots below the new count. Files written with
another slot size are started empty, with a warning; each instance name has
files of its own.

Shared budget (`sparse`): when several block geometries share the tier
(`sidecar.tiers.ssd.space`), each has files of its own, sized to the whole
budget but sparse: the disk behind a run of slots is reserved (`claim`,
fallocate) when the run's extent becomes the geometry's and given back
(`release`: records cleared, then a hole punched) when it stops being. The
journal is reserved whole when the files open: it is written through a
mapping, where a missing page on a full disk would be a SIGBUS.
The striping is extent-major for free: with `c` slots per directory in an
extent, the extent's slots k*c*n .. (k+1)*c*n-1 sit at the same byte range
of every directory's file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

import numpy as np
import xxhash

from shm.pool import buffer_view

try:
    from sidecar.tiers.ssd import _aio
except ImportError:  # not built: one transfer at a time, as before
    _aio = None  # type: ignore[assignment]

log = logging.getLogger("kvsidecar")

RECORD = struct.Struct("<4sIQ16s16s8sQ")
"""magic, flags, checksum, key, parent key, namespace tag, written (Unix ms).
The last two were 16 reserved zero bytes before: such a record belongs to
no namespace and has no age."""
RECORD_BYTES = RECORD.size  # 64
NO_TAG = bytes(8)
"""The namespace tag of a block whose namespace is not known."""
MAGIC = b"KVS1"
META_VERSION = 3
"""Of each directory's header (`<tag>.json`): version 2 added `asked_slots`,
version 3 `sparse` and `extra` (what the shared tier records: the layout)."""
VALID, FIRST = 1, 2
"""Record flags: the slot holds a block; the block starts a sequence (its
parent is the namespace root, not a stored block)."""
ALIGN = 4096
WRITE_BYTES = 2 << 20
"""What a writing thread has in flight at once (`SsdStore.write_run`): eight
256 KiB blocks, one of 2 MiB. 256 x 256 KiB on 4 threads, x the rate of
one synchronous write a block: raw writes four / eight / sixteen in flight
a thread 1.24 / 1.31 / 1.17x, the tier's (hashing them meanwhile) 1.08 /
1.20 / 1.17x (docs/measurements.md#ssd)."""
QUEUE_DEPTH = 32
"""Slots of each thread's AIO queue (`aio_queue`): the most blocks of
`write_run` in flight, for small slots."""
EMPTY_RECORD = bytes(RECORD_BYTES)


class SsdError(OSError):
    """An SSD tier directory cannot be used."""


def checksum(data: memoryview | np.ndarray, key: bytes) -> int:
    """xxh3-64 of the block, seeded by its key: a slot holding another key's
    bytes fails it as surely as a slot with flipped bits. The streaming call
    gives xxh3_64_intdigest's value but releases the GIL while it hashes."""
    hasher = checksum_stream(key)
    hasher.update(buffer_view(data))
    return hasher.intdigest()


def checksum_stream(key: bytes) -> xxhash.xxh3_64:
    """`checksum` fed piece by piece: its intdigest() after every piece of a
    block is that block's checksum."""
    return xxhash.xxh3_64(seed=int.from_bytes(key[:8], "little"))


@dataclass(frozen=True)
class Record:
    slot: int
    key: bytes
    parent: bytes
    first: bool
    checksum: int
    ns_tag: bytes = NO_TAG
    """The tag of the block's namespace (`NamespaceName.tag`)."""
    written_ms: int = 0
    """When the block was written, in Unix milliseconds (0: not known)."""


class _Dir:
    """One directory's data file, journal and metadata (`<tag>.data`,
    `.journal`, `.json`): several instance names may share a directory, each
    with its own files. The data file is flocked for the store's life, so a
    second sidecar of the same instance name on that directory is refused."""

    def __init__(
        self, path: Path, want: int, slot_bytes: int, tag: str, sparse: bool, extra: dict[str, Any]
    ) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        data_path, journal_path = path / f"{tag}.data", path / f"{tag}.journal"
        meta_path = path / f"{tag}.json"
        self.direct = True
        try:
            self.fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            log.warning("%s does not support O_DIRECT; using buffered I/O", path)
            self.direct = False
            self.fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise OSError(
                errno.EBUSY, "in use by another sidecar of this instance name", str(data_path)
            ) from None
        self.journal = os.open(journal_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.journal_map: mmap.mmap | None = None
        """The journal, mapped: records are written through it."""
        try:
            old = _read_meta(meta_path)
            if not _same_geometry(old, slot_bytes, tag, sparse, extra):
                if old is not None:
                    log.warning("SSD dir %s was written with %s; starting it empty", path, old)
                os.ftruncate(self.fd, 0)
                os.ftruncate(self.journal, 0)
                old = None
            if sparse:  # exactly `want` slots; the data's disk is reserved per extent
                self.nslots = want
                os.ftruncate(self.fd, want * slot_bytes)
                # The journal is written through a mapping: a page with no disk
                # behind it on a full filesystem would be SIGBUS, not ENOSPC.
                # It is all reserved now (1/64 of the data at 4 KiB slots).
                os.posix_fallocate(self.journal, 0, want * RECORD_BYTES)
            else:
                self.nslots = self._size(old, want, slot_bytes, tag)
                os.posix_fallocate(self.fd, 0, self.nslots * slot_bytes)
                os.posix_fallocate(self.journal, 0, self.nslots * RECORD_BYTES)
            meta = {
                "version": META_VERSION,
                "slot_bytes": slot_bytes,
                "slots": self.nslots,
                "asked_slots": want,
                "tag": tag,
                "sparse": sparse,
                "extra": extra,
            }
            tmp = path / f"{tag}.json.tmp"
            tmp.write_text(json.dumps(meta))
            os.replace(tmp, meta_path)
            self.journal_map = mmap.mmap(self.journal, self.nslots * RECORD_BYTES)
        except OSError:
            self.close()
            raise

    def _size(self, old: object, want: int, slot_bytes: int, tag: str) -> int:
        """The slot count, from the header `old` (None: new or emptied
        files). The same capacity asked for keeps the header's count,
        whatever the free space says now (it grows as our own files are
        counted in); another one refits and cuts the files to it, keeping
        the slots below the new count."""
        if not isinstance(old, dict):
            return _fit(self.path, want, slot_bytes, tag)
        had = int(old["slots"])
        if old.get("asked_slots", want) == want:  # a plain restart (version 1: assumed)
            return had
        nslots = _fit(self.path, want, slot_bytes, tag)
        if nslots < had:
            os.ftruncate(self.fd, nslots * slot_bytes)
            os.ftruncate(self.journal, nslots * RECORD_BYTES)
        log.warning(
            "SSD dir %s resized from %d to %d slots%s",
            self.path,
            had,
            nslots,
            f"; the blocks in the last {had - nslots} dropped" if nslots < had else "",
        )
        return nslots

    def close(self) -> None:
        journal, self.journal_map = self.journal_map, None
        if journal is not None:
            with contextlib.suppress(OSError):
                journal.flush()  # written back now, not at the kernel's leisure
            journal.close()
        for fd in (self.fd, self.journal):
            with contextlib.suppress(OSError):
                os.close(fd)


class SsdStore:
    """`num_slots` block slots over `dirs`, each directory holding at most
    `capacity_per_dir` bytes of slots. Safe to call from several threads at
    once for different slots (positional I/O only)."""

    def __init__(
        self,
        dirs: list[str],
        capacity_per_dir: int,
        slot_bytes: int,
        block_bytes: int,
        tag: str,
        *,
        sparse: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """`sparse`: exactly capacity_per_dir // slot_bytes slots a
        directory, in sparse files whose disk `claim` reserves (a shared
        tier); `extra`: what the header records beside the slot size (a
        header with other `extra` starts the files empty)."""
        if slot_bytes % ALIGN or not 0 < block_bytes <= slot_bytes:
            raise ValueError(f"slot_bytes must be a multiple of {ALIGN} holding a block")
        if not dirs:
            raise ValueError("no SSD directories")
        self.slot_bytes = slot_bytes
        self.block_bytes = block_bytes
        per_dir = capacity_per_dir // slot_bytes
        self._dirs: list[_Dir] = []
        try:
            for d in map(Path, dirs):
                self._dirs.append(_Dir(d, per_dir, slot_bytes, tag, sparse, extra or {}))
        except OSError as err:
            self.close()
            raise SsdError(err.errno, f"SSD tier: {err.strerror}", err.filename) from None
        # Slots are striped, so only as many per directory as the smallest holds.
        self.slots_per_dir = min(d.nslots for d in self._dirs)
        self.num_slots = self.slots_per_dir * len(self._dirs)
        self.checksums = np.zeros(self.num_slots, dtype=np.uint64)
        self.keys = np.zeros((self.num_slots, 16), dtype=np.uint8)
        self.direct = all(d.direct for d in self._dirs)
        self.ns_tags: dict[int, bytes] = {}
        """Namespace number -> its tag, recorded with each block written for
        it (set by the sidecar as namespaces register; read by I/O threads)."""
        self.recovered: dict[bytes, dict[bytes, int]] = {}
        """Namespace tag -> the trees recovered from the journals as that
        namespace's: the first key of each -> when its top was written (Unix
        ms). What a namespace registering after a restart claims."""

    def _where(self, slot: int) -> tuple[_Dir, int]:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"SSD slot {slot} out of range")
        n = len(self._dirs)
        return self._dirs[slot % n], (slot // n) * self.slot_bytes

    # ---- data ---------------------------------------------------------------

    def write(
        self,
        slot: int,
        block: memoryview,
        key: bytes,
        parent: bytes,
        first: bool,
        ns_tag: bytes = NO_TAG,
    ) -> None:
        """Store one block (a page-aligned view of slot_bytes) under `key`."""
        self.write_run([WriteBlock(slot, block, key, parent, first, ns_tag)])

    def write_run(self, blocks: Sequence[WriteBlock]) -> None:
        """Store each block (a page-aligned view of slot_bytes) in its slot.
        With Linux AIO (O_DIRECT files), blocks go down in groups of
        `write_depth`: the group's writes are all submitted, its blocks
        hashed while the device reads them, then the writes reaped. Without
        it, one `pwritev` after another, each block hashed first (the hash
        leaves it in the cache, where the write reads it). Measured in
        docs/measurements.md#ssd. A block's bytes cannot change meanwhile: a
        slot being written down is pinned. Each record goes invalid before
        its block's data changes and valid only once the data is written: a
        failed write (or a crash) leaves no record vouching for those
        slots. Bad arguments (a slot out of range, a view of another size)
        raise before anything is written."""
        places = [self._where(b.slot) for b in blocks]
        for b in blocks:
            if len(b.block) != self.slot_bytes:
                raise ValueError(f"a block of {len(b.block)} bytes for slots of {self.slot_bytes}")
        depth = self.write_depth
        queue = None if depth is None else aio_queue()
        step = depth or 1
        for i in range(0, len(blocks), step):
            self._write_group(queue, blocks[i : i + step], places[i : i + step])

    @property
    def write_depth(self) -> int | None:
        """Blocks this thread has in flight at once in `write_run`: WRITE_BYTES
        of them, at least one, at most QUEUE_DEPTH; None without Linux AIO
        (files not O_DIRECT, or no queue): one write at a time."""
        if not self.direct or aio_queue() is None:
            return None
        return max(1, min(QUEUE_DEPTH, WRITE_BYTES // self.slot_bytes))

    def _write_group(
        self, queue: Any, group: Sequence[WriteBlock], places: list[tuple[_Dir, int]]
    ) -> None:
        """Write the blocks (through `queue`, hashing them meanwhile; or one
        by one, hashed first, without one), then make their records valid."""
        for b, (d, _) in zip(group, places, strict=True):
            self._write_record(d, b.slot, EMPTY_RECORD)  # invalid while the data changes
        if queue is None:
            digests = [checksum(b.block[: self.block_bytes], b.key) for b in group]
            for b, (d, offset) in zip(group, places, strict=True):
                _pwrite_all(d.fd, b.block, offset)
        else:
            digests = self._hash_in_flight(queue, group, places)
        now_ms = time.time_ns() // 1_000_000
        for b, (d, _), digest in zip(group, places, digests, strict=True):
            flags = VALID | (FIRST if b.first else 0)
            record = RECORD.pack(MAGIC, flags, digest, b.key, b.parent, b.ns_tag, now_ms)
            self._write_record(d, b.slot, record)
            self.checksums[b.slot] = digest
            self.keys[b.slot] = np.frombuffer(b.key, dtype=np.uint8)

    def _hash_in_flight(
        self, queue: Any, group: Sequence[WriteBlock], places: list[tuple[_Dir, int]]
    ) -> list[int]:
        """Submit every block's write, hash the blocks, reap the writes (a
        short one completed in place); each block's checksum. On an error,
        nothing is left in flight."""
        try:
            at: dict[int, int] = {}
            for k, (b, (d, offset)) in enumerate(zip(group, places, strict=True)):
                at[queue.submit(d.fd, b.block, offset, True)] = k
            digests = [checksum(b.block[: self.block_bytes], b.key) for b in group]
            done = queue.wait(len(group))
        finally:
            _settle(queue)
        for qslot, n in done:
            k = at[qslot]
            if n < 0:
                raise OSError(-n, os.strerror(-n))
            if n < self.slot_bytes:
                d, offset = places[k]
                _pwrite_all(d.fd, group[k].block[n:], offset + n)
        return digests

    def read_run(self, blocks: Sequence[ReadBlock]) -> list[bool | None]:
        """`read` each block, the next one's read in flight while this one
        is checked (Linux AIO, where the files are O_DIRECT; else one `read`
        after another): 256 KiB blocks 0.97x the raw reads' rate against
        0.95x (docs/measurements.md#ssd). A block whose key its slot does
        not hold is not read. Per block: True if it read back intact, False
        if it failed its key or checksum, None if the device could not read
        it (EIO: a bad sector, a file cut short); the blocks after one that
        fails are still read."""
        ok: list[bool | None] = [self.keys[b.slot].tobytes() == b.key for b in blocks]
        todo = [i for i, good in enumerate(ok) if good]
        queue = aio_queue() if self.direct else None
        if queue is None:
            return [good and _unless_eio(self.read, *b) for b, good in zip(blocks, ok, strict=True)]
        try:
            if todo:
                queue.submit(*self._read_at(blocks[todo[0]]), False)
            for k, i in enumerate(todo):
                b = blocks[i]
                fd, _, offset = self._read_at(b)
                read = _unless_eio(_finish, queue, fd, b.block, offset)
                if k + 1 < len(todo):
                    queue.submit(*self._read_at(blocks[todo[k + 1]]), False)
                ok[i] = None if read is None else self._intact(b.slot, b.block, b.key)
        finally:
            _settle(queue)
        return ok

    def _read_at(self, b: ReadBlock) -> tuple[int, memoryview, int]:
        d, offset = self._where(b.slot)
        return d.fd, b.block, offset

    def read(self, slot: int, block: memoryview, key: bytes) -> bool:
        """Read the block into `block`; False if it fails its key or checksum
        (the caller must then treat it as a miss and drop the slot)."""
        d, offset = self._where(slot)
        if self.keys[slot].tobytes() != key:
            return False
        _pread_all(d.fd, block, offset)
        return self._intact(slot, block, key)

    def _intact(self, slot: int, block: memoryview, key: bytes) -> bool:
        """Whether the bytes read into `block` are the ones written to `slot`."""
        return checksum(block[: self.block_bytes], key) == int(self.checksums[slot])

    def drop(self, slot: int) -> None:
        """Forget a slot's block on disk too (its record is cleared)."""
        d, _ = self._where(slot)
        self._write_record(d, slot, EMPTY_RECORD)
        self.checksums[slot] = 0
        self.keys[slot] = 0

    def drop_slots(self, slots: np.ndarray) -> None:
        for slot in slots.tolist():
            self.drop(slot)

    def drop_stale(self, free: np.ndarray) -> int:
        """Clear the records that these free slots still hold: blocks evicted
        from the index keep theirs until their slot is written again (clearing
        it at eviction would cost a journal write per block inside the control
        loop). A clean stop calls this, so that the next start recovers the
        blocks that were indexed, not evicted or deleted ones. Returns how
        many were cleared."""
        stale = free[self.keys[free].any(axis=1)] if free.size else free
        self.drop_slots(stale)
        return int(stale.size)

    # ---- a shared tier's extents -----------------------------------------------------

    def _span(self, lo: int, hi: int) -> tuple[int, int]:
        """The per-directory slot range of slots lo..hi-1, which must be a
        whole number of stripes (lo and hi multiples of the directories)."""
        n = len(self._dirs)
        if lo % n or hi % n or not 0 <= lo <= hi <= self.num_slots:
            raise ValueError(f"slots {lo}..{hi - 1} are not whole stripes of this store")
        return lo // n, hi // n

    def claim(self, lo: int, hi: int) -> None:
        """Reserve the disk behind slots lo..hi-1 (an extent becoming this
        store's). Without room the slots stay holes: their writes may fail,
        and a failed write is a block not stored."""
        a, b = self._span(lo, hi)
        for d in self._dirs:
            try:
                os.posix_fallocate(d.fd, a * self.slot_bytes, (b - a) * self.slot_bytes)
            except OSError as err:
                log.warning("SSD dir %s: could not reserve an extent: %s", d.path, err)

    def release(self, lo: int, hi: int) -> None:
        """Give back slots lo..hi-1 (an extent leaving this store): their
        records are cleared and written back first, then the disk behind
        them is freed (a hole punched), so a crash between the two leaves
        holes that no record vouches for."""
        a, b = self._span(lo, hi)
        for d in self._dirs:
            journal = d.journal_map
            assert journal is not None, "the store is closed"
            journal[a * RECORD_BYTES : b * RECORD_BYTES] = bytes((b - a) * RECORD_BYTES)
            with contextlib.suppress(OSError):
                journal.flush()
            _punch_hole(d.fd, a * self.slot_bytes, (b - a) * self.slot_bytes)
        self.checksums[lo:hi] = 0
        self.keys[lo:hi] = 0

    def _write_record(self, d: _Dir, slot: int, record: bytes) -> None:
        at = (slot // len(self._dirs)) * RECORD_BYTES
        journal = d.journal_map
        assert journal is not None, "the store is closed"
        journal[at : at + RECORD_BYTES] = record

    # ---- recovery -----------------------------------------------------------------

    def records(self) -> list[Record]:
        """Every valid record in the journals (loads checksums and keys too)."""
        out = []
        n = len(self._dirs)
        for i, d in enumerate(self._dirs):
            assert d.journal_map is not None, "the store is closed"
            raw = d.journal_map[: self.slots_per_dir * RECORD_BYTES]
            for j in range(len(raw) // RECORD_BYTES):
                magic, flags, digest, key, parent, tag, written = RECORD.unpack_from(
                    raw, j * RECORD_BYTES
                )
                if magic != MAGIC or not flags & VALID:
                    continue
                slot = j * n + i
                self.checksums[slot] = digest
                self.keys[slot] = np.frombuffer(key, dtype=np.uint8)
                out.append(Record(slot, key, parent, bool(flags & FIRST), digest, tag, written))
        return out

    def close(self) -> None:
        for d in self._dirs:
            d.close()
        self._dirs = []


def _fit(path: Path, want: int, slot_bytes: int, tag: str) -> int:
    """Slots to preallocate in `path`: `want`, or what the filesystem has room for."""
    path.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(path)
    # Our own files (a restart) are reused whole; a 5% margin is kept of the
    # free space only, so a restart on a filesystem that has filled up since
    # still fits the slots its files hold (and keeps their blocks).
    ours = sum(_existing_bytes(path / f"{tag}.{ext}") for ext in ("data", "journal"))
    room = (ours + int(st.f_bavail * st.f_frsize * 0.95)) // (slot_bytes + RECORD_BYTES)
    if room < want:
        log.warning("SSD dir %s has room for %d of the %d slots asked for", path, room, want)
    if min(want, room) <= 0:
        raise OSError(errno.ENOSPC, "no room for a single block", str(path))
    return min(want, room)


def _same_geometry(
    meta: object, slot_bytes: int, tag: str, sparse: bool, extra: dict[str, Any]
) -> TypeGuard[dict[str, Any]]:
    """A header of files whose slots this store can keep using."""
    return (
        isinstance(meta, dict)
        and meta.get("version") in (1, 2, META_VERSION)
        and meta.get("slot_bytes") == slot_bytes
        and meta.get("tag") == tag
        and isinstance(meta.get("slots"), int)
        and meta["slots"] > 0
        and meta.get("sparse", False) == sparse
        and meta.get("extra", {}) == extra
    )


def read_header(path: Path) -> dict[str, Any] | None:
    """A directory header (`<tag>.json`), or None if absent or unreadable."""
    meta = _read_meta(path)
    return meta if isinstance(meta, dict) else None


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


_PUNCH_WARNED: set[int] = set()
"""Error numbers already logged by `_punch_hole` (once each)."""


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the disk behind a byte range, keeping the file's size. A
    filesystem without hole punching keeps the space (logged once)."""
    if length <= 0:
        return
    if _LIBC.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return
    err = ctypes.get_errno()
    if err not in _PUNCH_WARNED:
        _PUNCH_WARNED.add(err)
        log.warning("SSD tier: cannot punch holes (%s): a freed extent keeps its disk",
                    os.strerror(err))  # fmt: skip


def _existing_bytes(path: Path) -> int:
    """Space our own data file already holds there (reused on a restart)."""
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _read_meta(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unreadable"


class WriteBlock(NamedTuple):
    """A block for `SsdStore.write_run`."""

    slot: int
    block: memoryview
    key: bytes
    parent: bytes
    first: bool
    """The block starts its sequence (its parent is the namespace root)."""
    ns_tag: bytes = NO_TAG
    """Its namespace's tag, recorded for a restart (`Record.ns_tag`)."""


class ReadBlock(NamedTuple):
    """A block for `SsdStore.read_run`: as `SsdStore.read` takes it."""

    slot: int
    block: memoryview
    key: bytes


_local = threading.local()


def aio_queue() -> Any:
    """This thread's AIO queue of QUEUE_DEPTH slots, made on first use;
    None where Linux AIO is not there (not built, or io_setup refused: a
    container's seccomp profile, fs.aio-max-nr reached), and then for good."""
    queue = getattr(_local, "queue", False)
    if queue is False:
        queue = None
        if _aio is not None:
            try:
                queue = _aio.Queue(QUEUE_DEPTH)
            except OSError as err:
                log.info("SSD: Linux AIO unavailable (%s): one transfer at a time", err)
        _local.queue = queue
    return queue


def _finish(queue: Any, fd: int, view: memoryview, offset: int) -> bool:
    """Reap the one read in flight; a short one is completed in place."""
    ((_, done),) = queue.wait(1)
    if done < 0:
        raise OSError(-done, os.strerror(-done))
    if done < len(view):
        _pread_all(fd, view[done:], offset + done)
    return True


def _unless_eio(read: Callable[..., bool], *args: Any) -> bool | None:
    """`read(*args)`, or None if the device could not read the block (EIO):
    that block is lost, not the run. Other errors (the store closed, say)
    are the run's."""
    try:
        return read(*args)
    except OSError as err:
        if err.errno != errno.EIO:
            raise
        return None


def _settle(queue: Any) -> None:
    """Wait out a transfer left in flight by an error: its buffer is held
    until then, and the queue's next user must not reap it."""
    if queue is not None and queue.pending:
        queue.wait(queue.pending)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwritev(fd, [data[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short read: the file ends before the slot")
        done += n
