"""Names of the pool's segments: their two forms, validation and stale cleanup.

A pool with prefix P is named one of two ways, told apart by form alone, so a
name is all an attaching process needs:
- POSIX shm (the default): "/P.0", "/P.1", ... (files /dev/shm/P.0, ...);
- a directory D on a memory filesystem (a hugetlbfs mount, or a tmpfs mounted
  with huge=always): the absolute paths "D/P.0", "D/P.1", ...

A POSIX name has a single "/", the leading one; a path has at least two
components, which is why D may not be "/" itself. Prefixes and file names are
restricted to characters that are safe in a file name and cannot reach
outside their directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import posix_ipc

SHM_DIR = Path("/dev/shm")
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,250}")

log = logging.getLogger("kvsidecar")


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it is a safe segment-name prefix, else raise ValueError."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"bad shm prefix {prefix!r}: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return prefix


def validate_directory(directory: str) -> str:
    """Return `directory` if it is an absolute, normalised path other than "/",
    else raise ValueError. Whether it exists is checked where it is used."""
    if (
        not isinstance(directory, str)
        or not os.path.isabs(directory)
        or os.path.normpath(directory) != directory
        or directory.startswith("//")
        or directory == "/"
        or "\0" in directory
    ):
        raise ValueError(
            f"bad pool directory {directory!r}: give an absolute, normalised path "
            "other than / (e.g. /mnt/kvsidecar-huge)"
        )
    return directory


def is_file_path(name: str) -> bool:
    """Whether a (validated) segment name is a file path, not a POSIX shm name."""
    return name.find("/", 1) > 0


def validate_name(name: str) -> str:
    """Return `name` if it is a safe POSIX shm name ("/" then a safe file name)
    or an absolute path in a valid directory ending in a safe file name."""
    if isinstance(name, str) and name.startswith("/"):
        directory, _, file = name.rpartition("/")
        if not directory and _FILE.fullmatch(file):
            return name
        with contextlib.suppress(ValueError):
            if _FILE.fullmatch(file) and validate_directory(directory):
                return name
    raise ValueError(f"bad shm segment name {name!r}")


def segment_name(prefix: str, index: int, directory: str | None = None) -> str:
    """The name of segment `index` of the pool `prefix` (in `directory`, or POSIX shm)."""
    file = f"{validate_prefix(prefix)}.{index}"
    if directory is None:
        return "/" + file
    return f"{validate_directory(directory)}/{file}"


def remove_stale_segments(prefix: str, directory: str | None = None) -> list[str]:
    """Unlink every segment named `{prefix}.<n>` in `directory` (None: POSIX
    shm) that this user owns; returns the names removed, in the form
    `segment_name` gives.

    Only for a sidecar that has proved (by a lock it holds) that no live
    instance owns `prefix`. Never touches any other name. A file of another
    user under one of these names (a squatter in the sticky /dev/shm, or a
    sidecar of another user sharing a runtime directory) is left in place
    and logged as a warning: we may not remove it, and it is not ours to.
    """
    pattern = re.compile(re.escape(validate_prefix(prefix)) + r"\.(0|[1-9][0-9]*)")
    where = SHM_DIR if directory is None else Path(validate_directory(directory))
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.listdir(where)):
            if not pattern.fullmatch(entry) or not _ours(where / entry):
                continue
            if directory is None:
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_shared_memory("/" + entry)
                    removed.append("/" + entry)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where / entry)
                    removed.append(f"{directory}/{entry}")
    return removed


def _ours(path: Path) -> bool:
    """Whether this user owns `path` (not followed if a link); a file of
    another user is logged as a warning. False if it is gone."""
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return False
    if owner != os.getuid():
        log.warning(
            "shm segment %s belongs to uid %d, not to this user (uid %d): left in place; "
            "if no process of that user needs it, have it removed",
            path,
            owner,
            os.getuid(),
        )
        return False
    return True
