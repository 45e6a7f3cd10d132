"""Removing what a dead sidecar left: its shm segments, socket and lock file.

A sidecar killed by SIGKILL (or the OOM killer) cannot unlink its segments;
the next sidecar of the same name removes them when it starts. `kvsidecar
cleanup` does the same without starting one: it takes the instance lock
exactly as a starting sidecar does (`InstanceLock`, whose flock the kernel
drops when its holder dies), so it removes nothing while a live process
holds the name, then removes the leftovers and releases the lock. A lock
file can be removed under a live sidecar (a /tmp cleaner), so the instance's
socket and the endpoints it is configured with are tried too: one that
accepts a connection is live, and nothing is removed either.

Only this user's instances in one runtime directory are in reach: the shm
names carry the uid and a digest of the runtime directory
(`contract.endpoint`), and only files this user owns are removed.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

from contract.endpoint import INSTANCE_PATTERN, InstancePaths
from shm import hotindex
from shm.names import SHM_DIR, is_file_path, remove_stale_segments, segment_name
from sidecar.runtime import (
    InstanceLock,
    InstanceRunning,
    ensure_runtime_dir,
    probe_socket,
    refuse_if_endpoint_served,
    remove_created,
)


class Removed(NamedTuple):
    """What cleaning one instance removed."""

    instance: str
    segments: tuple[str, ...]
    """Segment names, as `shm.names.segment_name` gives them."""
    files: tuple[Path, ...]
    """The socket, the admin token and the lock file, those that were there."""
    freed_bytes: int
    """The segments' sizes added up: shared memory given back once no
    process maps them any more."""
    kept: tuple[str, ...] = ()
    """What was left in place and why, one line each: another user's socket."""


def clean_instance(
    paths: InstancePaths, shm_dir: str | None = None, endpoints: tuple[str, ...] = ()
) -> Removed:
    """Remove the shm segments (in `shm_dir`, None: POSIX shm), the socket
    and the lock file of the instance `paths` names, after proving with its
    lock, and by connecting to its socket and to the other `endpoints` it
    was configured with (a custom `endpoint`, the events endpoints), that
    no live process holds it. Those endpoints' ipc sockets, dead and ours,
    are removed too. Only this user's files are removed: a segment of
    another user under the instance's names is logged as a warning, its
    socket is kept (and listed in `kept`).

    Raises InstanceRunning, having removed nothing, while a process holds
    the lock or listens on a socket or endpoint; UnsafeRuntimeDir for a
    runtime directory a sidecar would refuse; OSError as the file system
    does. A missing runtime directory holds no lock: then (the endpoints
    tried first) only the segments and the endpoints' sockets are removed,
    and the directory is not made (systemd removes its RuntimeDirectory
    with the service, and the sidecar's user may not make it again).
    """
    for endpoint in endpoints:  # a live sidecar on a custom endpoint lost its lock file
        refuse_if_endpoint_served(
            endpoint, f"instance {paths.instance!r} may be live: stop it first"
        )
    if not os.path.lexists(paths.runtime_dir):
        segments, freed = _remove_segments(paths, shm_dir)
        return Removed(
            paths.instance, segments, _remove_endpoint_sockets(endpoints, paths.instance), freed
        )
    had_lock = paths.lock_path.exists()
    created = ensure_runtime_dir(paths.runtime_dir)
    files: list[Path] = []
    kept: list[str] = []
    try:
        lock = InstanceLock(paths)
        try:
            socket_owner = _dead_socket_owner(paths.socket_path, paths.instance)
            segments, freed = _remove_segments(paths, shm_dir)
            if socket_owner == os.getuid() and _remove_socket(paths.socket_path):
                files.append(paths.socket_path)
            elif socket_owner is not None:
                kept.append(f"{paths.socket_path}: the socket of uid {socket_owner}, not ours")
            if _remove_file(paths.admin_token_path):
                files.append(paths.admin_token_path)
            files += _remove_endpoint_sockets(endpoints, paths.instance)
        finally:
            lock.release()
    finally:
        remove_created(created)
    if had_lock:
        files.append(paths.lock_path)
    return Removed(paths.instance, segments, tuple(files), freed, tuple(kept))


def _remove_segments(paths: InstancePaths, shm_dir: str | None) -> tuple[tuple[str, ...], int]:
    """Remove the instance's segments and hot indexes: (their names, their bytes)."""
    sizes = _segment_sizes(paths.shm_prefix, shm_dir)
    segments = tuple(remove_stale_segments(paths.shm_prefix, shm_dir))
    segments += tuple(hotindex.remove_stale(paths.shm_prefix))
    return segments, sum(sizes.get(name, 0) for name in segments)


def _dead_socket_owner(path: Path, instance: str) -> int | None:
    """The uid owning the socket at `path` (of instance `instance`), a
    socket nothing listens on; None if there is no socket there. Raises
    InstanceRunning if a process listens on it: the lock file may have been
    removed under a live sidecar (a /tmp cleaner), or another instance
    serves that path."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(info.st_mode):
        return None
    err = probe_socket(path)
    if err is not None and err.errno == errno.ECONNREFUSED:
        return info.st_uid
    if err is not None and err.errno == errno.ENOENT:
        return None
    answer = "it accepted a connection" if err is None else err.strerror
    raise InstanceRunning(
        f"a live process listens on {path}, the socket of instance {instance!r} "
        f"({answer}); stop it first"
    )


def instances_in(runtime_dir: Path, shm_dir: str | None = None) -> list[str]:
    """The instance names this user has anything of in `runtime_dir`: a
    lock file, a socket, or shm segments (in `shm_dir`, None: POSIX shm)
    whose names carry this directory's digest. Live instances included."""
    names = set()
    try:
        entries = os.listdir(runtime_dir)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for entry in entries:
        stem, dot, suffix = entry.rpartition(".")
        if dot and suffix in ("lock", "sock", "admin") and re.fullmatch(INSTANCE_PATTERN, stem):
            names.add(stem)
    # kvsidecar.<uid>.<instance>.<digest>: the instance is what lies between.
    head, _, digest = InstancePaths(runtime_dir, "x").shm_prefix.rpartition(".")
    head = head.removesuffix(".x")
    segment = re.compile(
        rf"{re.escape(head)}\.({INSTANCE_PATTERN})\.{re.escape(digest)}\.(0|[1-9][0-9]*)"
    )
    for entry in _shm_entries(shm_dir):
        match = segment.fullmatch(entry)
        if match:
            names.add(match.group(1))
    return sorted(names)


def _shm_entries(shm_dir: str | None) -> list[str]:
    try:
        return os.listdir(SHM_DIR if shm_dir is None else shm_dir)
    except FileNotFoundError:
        return []


def _segment_sizes(prefix: str, shm_dir: str | None) -> dict[str, int]:
    """Segment name -> size, for the segments `remove_stale_segments` would remove."""
    pattern = re.compile(re.escape(prefix) + r"\.(0|[1-9][0-9]*)")
    sizes = {}
    for entry in _shm_entries(shm_dir):
        match = pattern.fullmatch(entry)
        if match is None:
            continue
        name = segment_name(prefix, int(match.group(1)), shm_dir)
        path = name if is_file_path(name) else str(SHM_DIR) + name
        try:
            sizes[name] = os.stat(path, follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return sizes


def _remove_endpoint_sockets(endpoints: tuple[str, ...], instance: str) -> tuple[Path, ...]:
    """The ipc sockets of `endpoints` that are this user's and refuse
    connections (their process is gone), removed; their paths."""
    removed = []
    for endpoint in endpoints:
        path = Path(endpoint.removeprefix("ipc://"))
        if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
            continue
        if _dead_socket_owner(path, instance) == os.getuid() and _remove_socket(path):
            removed.append(path)
    return tuple(removed)


def _remove_socket(path: Path) -> bool:
    """Unlink `path` if it is a socket (never anything else); whether it was.
    Only for a socket `_dead_socket_owner` found dead and ours."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _remove_file(path: Path) -> bool:
    """Remove a regular file (not a link); whether there was one."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
