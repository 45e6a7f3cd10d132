"""The runtime directory and the instance lock of a running sidecar. The
names (socket, lock, shm prefix) are `contract.endpoint.InstancePaths`.

The instance lock is an `flock` on `<runtime_dir>/<instance>.lock`, held for
the process's whole life. The kernel drops it when the process dies, even by
SIGKILL, so a starting sidecar that gets the lock knows that any socket or
shm segment with its names was left by a dead predecessor and removes them.
That holds only because the shm names include a digest of the runtime
directory (see `contract.endpoint`).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from contract import endpoint
from contract.endpoint import InstancePaths
from sidecar.config import Config


class InstanceRunning(RuntimeError):
    """Another live sidecar already serves this instance name."""


def instance_paths(config: Config) -> InstancePaths:
    return endpoint.instance_paths(config.runtime_dir, config.instance)


def endpoint_of(config: Config) -> str:
    """The endpoint a sidecar with this config serves (and clients connect to)."""
    return config.endpoint or instance_paths(config).default_endpoint


def ensure_runtime_dir(path: Path) -> None:
    """Create the directory with mode 0700, or check that an existing one is
    ours and private (the socket in it accepts control messages)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"runtime dir {path} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


class InstanceLock:
    """The flock that makes one process the owner of an instance name."""

    def __init__(self, paths: InstancePaths) -> None:
        ensure_runtime_dir(paths.runtime_dir)
        self.path = paths.lock_path
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise InstanceRunning(
                    f"sidecar instance {paths.instance!r} is already running"
                    + (f" (pid {holder})" if holder else "")
                    + f"; stop it or pick another --instance (lock: {self.path})"
                ) from None
            if _same_file(fd, self.path):
                break
            # The owner released it between our open and our flock: we hold
            # a lock on a removed file, which locks nobody out. Again.
            os.close(fd)
        else:
            raise InstanceRunning(f"could not lock {self.path}: it keeps being replaced")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlink the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing the fd drops the flock
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open at `fd`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
