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

import errno
import fcntl
import os
import stat
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


class UnsafeRuntimeDir(PermissionError):
    """The runtime directory is not one only we control: a symlink, not a
    directory, another user's, or writable by group or others."""


def ensure_runtime_dir(path: Path) -> list[Path]:
    """Make `path` a directory only we control, for the socket and lock.

    Missing directories (parents included) are created with mode 0700; an
    existing one is never changed (chmod), only checked: UnsafeRuntimeDir if
    it is a symlink, not a directory, owned by another user, or writable by
    group or others. A symlink in a parent is followed (/var/run -> /run is
    common); the last component is opened O_NOFOLLOW and checked by its fd,
    so what is checked is what the socket and lock go in.

    Returns the directories this call created, outermost first, for
    `remove_created` to take back after a failed start.
    """
    if not path.is_absolute():
        raise UnsafeRuntimeDir(f"runtime dir {path} is not an absolute path")
    created: list[Path] = []
    for directory in (*reversed(path.parents), path):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue
        except OSError:
            remove_created(created)
            raise
        created.append(directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        remove_created(created)
        if err.errno == errno.ELOOP or os.path.islink(path):
            raise UnsafeRuntimeDir(
                f"runtime dir {path} is a symlink; a sidecar never follows one there: "
                "remove it, or set runtime_dir to a private directory of your own"
            ) from None
        if err.errno == errno.ENOTDIR:
            raise UnsafeRuntimeDir(
                f"runtime dir {path} is not a directory: remove it or set another runtime_dir"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise UnsafeRuntimeDir(
                f"runtime dir {path} belongs to uid {st.st_uid}, not to uid {os.getuid()}: "
                "set runtime_dir to a directory of your own"
            )
        if path in created:
            os.fchmod(fd, 0o700)  # ours: whatever the umask took off
        elif st.st_mode & 0o022:
            raise UnsafeRuntimeDir(
                f"runtime dir {path} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by "
                "group or others, who could replace the socket: set runtime_dir to a "
                f"private directory (mode 0700), or run chmod go-w {path} if it is yours alone"
            )
    except BaseException:
        remove_created(created)
        raise
    finally:
        os.close(fd)
    return created


def remove_created(created: list[Path]) -> None:
    """Remove the directories `ensure_runtime_dir` created (listed outermost
    first), innermost first, stopping at the first that is not empty."""
    for directory in reversed(created):
        try:
            os.rmdir(directory)
        except OSError:
            return


class InstanceLock:
    """The flock that makes one process the owner of an instance name, in
    a runtime directory that `ensure_runtime_dir` has checked."""

    def __init__(self, paths: InstancePaths) -> None:
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
