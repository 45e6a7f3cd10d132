"""Shared-memory names for tests: unique per process and test, checked clean after."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import posix_ipc

from shm.names import SHM_DIR


def unique_prefix(tag: str) -> str:
    """A segment prefix no other test (or xdist worker) uses."""
    return f"kvtest.{tag}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def shm_entries(prefix: str) -> list[str]:
    """Every /dev/shm entry whose name starts with `prefix`."""
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(prefix))


@contextlib.contextmanager
def checked_prefix(tag: str) -> Iterator[str]:
    """Yield a fresh prefix; afterwards remove what is left under it, then fail if
    anything was: a test must clean up what it creates."""
    prefix = unique_prefix(tag)
    yield prefix
    left = shm_entries(prefix)
    for entry in left:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + entry)
    assert not left, f"shm segments left behind: {left}"
