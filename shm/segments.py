"""One segment by name: open, create, remove; and where a new pool may go.

POSIX names go through shm_open (posix_ipc); file paths through open(2) with
O_NOFOLLOW, and only on a memory filesystem (`shm.pages`). Both hand the pool
a plain fd, so it maps either kind the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import NamedTuple

import posix_ipc

from shm.layout import PAGE_BYTES
from shm.names import SHM_DIR, is_file_path, validate_directory
from shm.pages import backing_of, hugetlb_pages_free, statfs

SEGMENT_MODE = 0o600
"""What a segment is created with; `ShmPool.create` may widen it afterwards."""


class ShmPoolError(RuntimeError):
    """A segment is missing, already exists, has the wrong size, or the pool is
    closed; or the place for a new pool is unusable or lacks the room."""


class Place(NamedTuple):
    """Where a new pool's segments go."""

    directory: str | None
    """None: POSIX shm in /dev/shm."""
    fs: str
    """"tmpfs" or "hugetlbfs"."""
    page_bytes: int
    """Segment sizes are a multiple of this: 4 KiB for POSIX shm; in a
    directory, its huge page size, so every byte can be a huge page."""


def place_of(directory: str | None) -> Place:
    """Check `directory` (None: POSIX shm) can hold a pool. Raises ValueError
    for a malformed path, ShmPoolError for one that is missing or not on tmpfs
    or hugetlbfs."""
    if directory is None:
        return Place(None, "tmpfs", PAGE_BYTES)
    validate_directory(directory)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise ShmPoolError(
            f"pool directory {directory} does not exist or is not a directory: mount a "
            "hugetlbfs, or a tmpfs with huge=always, there first"
        ) from exc
    try:
        backing = backing_of(fd)
        magic = statfs(fd)[0]
    finally:
        os.close(fd)
    if backing is None:
        raise ShmPoolError(
            f"pool directory {directory} is not on tmpfs or hugetlbfs (statfs type "
            f"{magic:#x}): its pages would be written back to that filesystem"
        )
    return Place(directory, backing.fs, backing.page_bytes)


def check_room(place: Place, total: int) -> None:
    """Raise ShmPoolError unless `place` has `total` bytes free."""
    where = SHM_DIR if place.directory is None else place.directory
    st = os.statvfs(where)
    limited = place.fs == "tmpfs" or st.f_blocks > 0  # hugetlbfs without size= has no limit
    free = st.f_bavail * st.f_frsize if limited else total
    if place.fs == "hugetlbfs":
        free = min(free, hugetlb_pages_free(place.page_bytes) * place.page_bytes)
    if free >= total:
        return
    if place.fs == "hugetlbfs":
        pages, need = free // place.page_bytes, total // place.page_bytes
        raise ShmPoolError(
            f"{where} can get {pages} more huge pages of {place.page_bytes >> 10} KiB, the pool "
            f"needs {need}: reserve more (/proc/sys/vm/nr_hugepages) or shrink the CPU tier"
        )
    raise ShmPoolError(
        f"{where} has {free:,} bytes free, the pool needs {total:,}: "
        "shrink the CPU tier or free shared memory"
    )


@contextlib.contextmanager
def open_segment(name: str, *, create: bool, read_only: bool = False) -> Iterator[int]:
    """An fd of segment `name` (validated), closed on exit. With `create`, a
    new empty segment of mode 0600; else an existing one, which for a path
    must be a regular file on a memory filesystem (`read_only`: opened so,
    which its mode may be all that allows)."""
    if not is_file_path(name):
        try:
            flags = posix_ipc.O_CREX if create else 0
            memory = posix_ipc.SharedMemory(name, flags, mode=SEGMENT_MODE, read_only=read_only)
        except posix_ipc.ExistentialError as exc:
            raise (_exists(name) if create else _missing(name)) from exc
        try:
            yield memory.fd
        finally:
            memory.close_fd()
        return
    access = os.O_RDONLY if read_only else os.O_RDWR
    flags = access | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(name, flags, SEGMENT_MODE)
    except FileExistsError as exc:
        raise _exists(name) from exc
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise _missing(name) from exc
        if exc.errno == errno.ELOOP:
            raise ShmPoolError(f"shm segment {name} is a symbolic link: refused") from exc
        raise
    try:
        if not create and (not stat.S_ISREG(os.fstat(fd).st_mode) or backing_of(fd) is None):
            raise ShmPoolError(f"shm segment {name} is not a file on tmpfs or hugetlbfs")
        yield fd
    finally:
        os.close(fd)


def remove_segment(name: str) -> None:
    """Unlink segment `name`; nothing if it is gone already."""
    if is_file_path(name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    else:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)


def _exists(name: str) -> ShmPoolError:
    return ShmPoolError(
        f"shm segment {name} already exists: another sidecar owns this prefix, "
        "or a dead one left it (remove_stale_segments, once you hold the lock)"
    )


def _missing(name: str) -> ShmPoolError:
    return ShmPoolError(f"shm segment {name} does not exist")
