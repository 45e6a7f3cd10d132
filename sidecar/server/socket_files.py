"""The files of the ipc:// sockets a sidecar binds (its engines' endpoint,
the KV event endpoints): claimed before the bind, removed at close only
while they are still the ones it bound.

libzmq unlinks whatever is at an ipc path before it binds there, so the
claim is the only check: a regular file is never replaced, a socket some
live process serves is never taken over, and a socket another user owns is
never removed. Only a socket that refuses connections (its process is gone)
is cleared. An abstract name (`ipc://@name`) has no file.

From the claim to the end of the bind, the socket's directory is locked
(`flock`): two sidecars started at once on one path both found it free
before either bound, and both said they served.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

from sidecar.runtime import InstanceRunning, probe_socket


class SocketFile:
    def __init__(self, path: str, dir_lock: int | None = None) -> None:
        self.path = path
        self._dir_lock = dir_lock
        """An fd of the socket's directory, flock'ed until the bind is done."""
        self._bound: tuple[int, int, int] | None = None
        """(device, inode, mtime) of the socket this process bound: an inode
        number alone may be given again to a socket bound there since."""

    @classmethod
    def claim(cls, endpoint: str) -> SocketFile | None:
        """The file of `endpoint`, made free for our bind (`claim_socket_file`);
        None for an endpoint with no file."""
        path = endpoint.removeprefix("ipc://")
        if not endpoint.startswith("ipc://") or path.startswith("@"):
            return None
        lock = _lock_dir(os.path.dirname(path) or ".")
        try:
            claim_socket_file(path)
        except BaseException:
            _unlock(lock)
            raise
        return cls(path, lock)

    def bound(self) -> None:
        """Call after the bind: the file there now is ours (and the
        directory is unlocked)."""
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            self._bound = (st.st_dev, st.st_ino, st.st_mtime_ns)
        self.release()

    def release(self) -> None:
        """Unlock the directory (a bind that failed; idempotent)."""
        lock, self._dir_lock = self._dir_lock, None
        _unlock(lock)

    def remove(self) -> None:
        """Unlink the socket file if it is still the one this process bound
        (another process may have bound that path since)."""
        self.release()
        bound, self._bound = self._bound, None
        if bound is None:
            return
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino, st.st_mtime_ns) == bound:
                os.unlink(self.path)


def claim_socket_file(path: str) -> None:
    """Make `path` free for our ipc socket: a socket of ours that refuses
    connections (its process is gone) is removed; one a live process
    accepts connections on raises InstanceRunning; anything that is not a
    socket, a socket another user owns, or one whose liveness cannot be
    told, is never touched (FileExistsError / PermissionError)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            errno.EEXIST, "exists and is not a socket; pick another endpoint", path
        )
    if st.st_uid != os.geteuid():
        raise PermissionError(
            errno.EPERM, f"a socket of uid {st.st_uid}, not ours; pick another endpoint", path
        )
    err = probe_socket(path)
    if err is not None and err.errno == errno.ECONNREFUSED:
        os.unlink(path)  # left by a dead process
        return
    if err is not None:  # a full backlog: someone may be there
        raise InstanceRunning(
            f"ipc://{path} may be served by a live process ({err}); "
            "stop it or pick another endpoint"
        )
    raise InstanceRunning(
        f"ipc://{path} is served by another live process; stop it or pick another endpoint"
    )


def _lock_dir(path: str) -> int | None:
    """An fd of directory `path`, flock'ed (waiting for another sidecar's
    claim and bind there); None where it cannot be opened (the bind will
    say why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # the flock goes with it
