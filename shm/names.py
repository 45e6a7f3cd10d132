"""Names of the pool's shared-memory segments: validation and stale cleanup.

A pool with prefix P has segments /P.0, /P.1, ... (files /dev/shm/P.0, ...).
Prefixes are restricted to characters that are safe in a file name and
cannot reach outside /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import posix_ipc

SHM_DIR = Path("/dev/shm")
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_NAME = re.compile(r"/[A-Za-z0-9][A-Za-z0-9._-]{0,250}")


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it is a safe segment-name prefix, else raise ValueError."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"bad shm prefix {prefix!r}: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return prefix


def validate_name(name: str) -> str:
    """Return `name` if it is a safe POSIX shm name ("/" then a safe file name)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"bad shm segment name {name!r}")
    return name


def segment_name(prefix: str, index: int) -> str:
    """The POSIX name of segment `index` of the pool `prefix`."""
    return f"/{validate_prefix(prefix)}.{index}"


def remove_stale_segments(prefix: str) -> list[str]:
    """Unlink every segment named `/{prefix}.<n>`; returns the names removed.

    Only for a sidecar that has proved (by a lock it holds) that no live
    instance owns `prefix`. Never touches any other name.
    """
    pattern = re.compile(re.escape(validate_prefix(prefix)) + r"\.(0|[1-9][0-9]*)")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.listdir(SHM_DIR)):
            if pattern.fullmatch(entry):
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_shared_memory("/" + entry)
                    removed.append("/" + entry)
    return removed
