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

import contextlib
import errno
import fcntl
import logging
import os
import resource
import secrets
import socket
import stat
from pathlib import Path

from contract import endpoint
from contract.endpoint import InstancePaths
from sidecar.config import Config, ConfigError

log = logging.getLogger("kvsidecar")


class InstanceRunning(RuntimeError):
    """Another live sidecar already serves this instance name."""


def instance_paths(config: Config) -> InstancePaths:
    return endpoint.instance_paths(config.runtime_dir, config.instance)


def endpoint_of(config: Config) -> str:
    """The endpoint a sidecar with this config serves (and clients connect to)."""
    return config.endpoint or instance_paths(config).default_endpoint


class UnsafeRuntimeDir(PermissionError):
    """The runtime directory is not one only we control: a symlink, not a
    directory, another user's, or writable by group or others; or, with a
    `group` to serve, one that group cannot search."""


RUNTIME_DIR_MODE = 0o700
SHARED_RUNTIME_DIR_MODE = 0o750
"""With `group` set: members may reach the socket, but not replace it or the lock."""
SHARED_FILE_MODE = 0o660
"""With `group` set: the ipc socket and the shm segments."""
SHARED_READ_MODE = 0o640
"""With `group` set: the hot indexes, which engines only read (the sidecar
trusts what it wrote there, so nobody else may write them)."""


def ensure_runtime_dir(path: Path, gid: int | None = None) -> list[Path]:
    """Make `path` a directory only we control, for the socket and lock.

    Missing directories (parents included) are created with mode 0700, or
    with `gid` 0750 and of group `gid`; an existing one is never changed
    (chmod, chown), only checked: UnsafeRuntimeDir if it is a symlink, not a
    directory, owned by another user, or writable by group or others; with
    `gid` also if that group cannot search it. A symlink in a parent is
    followed (/var/run -> /run is common); the last component is opened
    O_NOFOLLOW and checked by its fd, so what is checked is what the socket
    and lock go in. With `gid`, a parent the group cannot search is logged
    as a warning (an ACL may still let it through).

    Returns the directories this call created, outermost first, for
    `remove_created` to take back after a failed start.
    """
    if not path.is_absolute():
        raise UnsafeRuntimeDir(f"runtime dir {path} is not an absolute path")
    mode = RUNTIME_DIR_MODE if gid is None else SHARED_RUNTIME_DIR_MODE
    created: list[Path] = []
    try:
        for directory in (*reversed(path.parents), path):
            try:
                os.mkdir(directory, mode)
            except FileExistsError:
                continue
            created.append(directory)
            _set_access(directory, mode, gid)
        _check_runtime_dir(path, gid)
    except BaseException:
        remove_created(created)
        raise
    if gid is not None:
        _warn_unsearchable_parents(path, gid)
    return created


def _set_access(directory: Path, mode: int, gid: int | None) -> None:
    """Give a directory we just made its group, then its mode (whatever the
    umask took off), through an fd: a name swapped meanwhile is not followed."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _check_runtime_dir(path: Path, gid: int | None) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
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
    finally:
        os.close(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        raise UnsafeRuntimeDir(
            f"runtime dir {path} belongs to uid {st.st_uid}, not to uid {os.getuid()}: "
            "set runtime_dir to a directory of your own"
        )
    if mode & 0o022:
        raise UnsafeRuntimeDir(
            f"runtime dir {path} (mode {mode:04o}) is writable by "
            "group or others, who could replace the socket: set runtime_dir to a "
            f"private directory (mode 0700), or run chmod go-w {path} if it is yours alone"
        )
    if gid is not None and not (st.st_gid == gid and mode & 0o010):
        raise UnsafeRuntimeDir(
            f"runtime dir {path} (mode {mode:04o}, gid {st.st_gid}) cannot be searched by "
            f"group {gid}, whose engines then cannot reach the socket: run "
            f"chgrp {gid} {path} && chmod 0750 {path}, or let the sidecar make it"
        )


def _warn_unsearchable_parents(path: Path, gid: int) -> None:
    for parent in path.parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        if not (st.st_mode & 0o001 or (st.st_gid == gid and st.st_mode & 0o010)):
            log.warning(
                "group %d cannot search %s (mode %04o), a parent of the runtime dir %s: "
                "its engines will not reach the socket unless an ACL lets them",
                gid,
                parent,
                stat.S_IMODE(st.st_mode),
                path,
            )
            return


def check_group_member(gid: int) -> None:
    """ConfigError (naming the `group` key) unless this process may give
    its files to group `gid`: it is root, or a member of the group."""
    if os.geteuid() == 0 or gid == os.getegid() or gid in os.getgroups():
        return
    raise ConfigError(
        f"group: this sidecar's user (uid {os.geteuid()}) is not in group {gid}, so it "
        "cannot give the socket and shm segments to it: add the user to the group "
        "(usermod -aG), or run the sidecar with that group (systemd Group=)"
    )


def share_socket_file(endpoint: str, gid: int) -> None:
    """Give the ipc socket file `endpoint` binds (nothing for tcp:// or an
    abstract ipc://@name) to group `gid`, mode 0660, once it is bound. Until
    then it has the mode the umask left, never more than 0660 for the group
    once changed; the runtime directory (0750) keeps others away meanwhile."""
    path = endpoint.removeprefix("ipc://")
    if endpoint == path or path.startswith("@"):
        return
    os.chown(path, -1, gid, follow_symlinks=False)
    os.chmod(path, SHARED_FILE_MODE)


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
        self._unkept = False
        """Whether `keep` failed to make the removed lock file again (said once)."""

    def keep(self) -> None:
        """Make the lock file again if it was removed (a /tmp cleaner):
        while it is missing, a second start of the instance takes a new one
        and, finding no live socket of its own to stop it (a custom
        endpoint), removes this sidecar's segments as a dead one's. Never
        raises: what it cannot do (its directory went too, another process
        locked a new file first) it logs, once until it succeeds."""
        if self._fd is None or _same_file(self._fd, self.path):
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as err:
            self._cannot_keep(f"cannot make it again: {err}")
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _same_file(fd, self.path):  # replaced again meanwhile: next time
                os.close(fd)
                return
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BlockingIOError:
            os.close(fd)
            self._cannot_keep("another process locked it: a second sidecar of it may be starting")
            return
        except OSError as err:
            os.close(fd)
            self._cannot_keep(f"cannot write it: {err}")
            return
        os.close(self._fd)
        self._fd = fd
        self._unkept = False
        log.warning("the lock file %s was removed: made again", self.path)

    def _cannot_keep(self, why: str) -> None:
        if not self._unkept:
            log.error("the lock file %s was removed and %s", self.path, why)
        self._unkept = True

    def release(self) -> None:
        """Unlink the lock file, if it is still ours, and drop the lock
        (idempotent)."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
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


class AdminToken:
    """What proves a client may administer this sidecar (`kvsidecar clear`):
    a random token in `<runtime_dir>/<instance>.admin`, mode 0600, so only
    the sidecar's own user (and root) can read it. Engines of other users
    that the `group` setting lets connect cannot. Made once the instance
    lock is held (a dead predecessor's is replaced), removed at close."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.value = secrets.token_hex(32)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            os.write(fd, self.value.encode())
        finally:
            os.close(fd)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read_admin_token(path: Path) -> str:
    """The token a running sidecar wrote; OSError (e.g. PermissionError for
    another user, FileNotFoundError with no sidecar) as open raises it."""
    return path.read_text(encoding="ascii").strip()


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, and
    return the limit now in force. Engines' connections, SSD files and the
    metrics port's connections share it, and libzmq aborts the process when
    it runs out (systemd's default soft limit is 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as err:
            log.warning("open files limit stays at %d: %s", soft, err)
    return soft


def refuse_if_served(path: str | os.PathLike[str], hint: str) -> None:
    """InstanceRunning (its message ending with `hint`) if a process may be
    listening on the Unix socket at `path` (it accepted a connection, or its
    backlog is full); nothing if there is no socket there or nobody listens
    (its process is gone). A sidecar asks before it removes anything a dead
    one left: holding the instance's lock is not proof enough, as the lock
    file of a live sidecar may have been removed under it (a /tmp cleaner)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        return
    err = probe_socket(path)
    if err is not None and err.errno in (errno.ECONNREFUSED, errno.ENOENT):
        return
    answer = "it accepted a connection" if err is None else err.strerror
    raise InstanceRunning(
        f"ipc://{os.fspath(path)} is served by another live process ({answer}); {hint}"
    )


def refuse_if_endpoint_served(endpoint: str, hint: str) -> None:
    """`refuse_if_served` for a ZeroMQ endpoint: an ipc:// path's socket is
    tried as there; a tcp:// address is connected to (a wildcard host on
    its loopback address), and one that accepts is served (a bind there
    would fail anyway). Abstract ipc names and other transports: nothing."""
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if path and not path.startswith("@"):
            refuse_if_served(path, hint)
        return
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    host = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if not port.isascii() or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            pass
    except OSError:  # refused, unreachable, no such host: nobody serves there
        return
    raise InstanceRunning(f"{endpoint} is served by another live process; {hint}")


def probe_socket(path: str | os.PathLike[str]) -> OSError | None:
    """Connect to the Unix socket at `path` without waiting: None if a
    process accepted, else why not. Only ECONNREFUSED means nobody listens
    (its process is gone); EAGAIN (a full backlog) means someone is there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        code = probe.connect_ex(os.fspath(path))
    return None if code == 0 else OSError(code, os.strerror(code), os.fspath(path))
