"""Where a sidecar instance listens, and the names of what it owns on the host.

Everything follows from (user, runtime directory, instance name): the
socket `<runtime_dir>/<instance>.sock`, the lock `<runtime_dir>/<instance>.lock`
and the shm segment prefix. The daemon (`sidecar.runtime`) creates them; an
engine finds the default endpoint here from three environment variables,
without loading the daemon's configuration.

A tcp:// endpoint off loopback needs ZeroMQ CURVE (the daemon refuses
one otherwise); an engine names its key files in two more variables,
KVSIDECAR_CURVE_SERVER_KEY and KVSIDECAR_CURVE_CLIENT_KEY (`curve_client_keys`).

The shm names include a digest of the runtime directory: two sidecars of one
instance name with different runtime directories (one started with
XDG_RUNTIME_DIR set, one without) hold different locks, and must not take
each other's segments for leftovers.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth

DEFAULT_INSTANCE = "default"
INSTANCE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
ENDPOINT_PREFIXES = ("ipc://", "tcp://")

# The daemon's configuration keys of the same names (sidecar.config) read the
# same variables; these are the only ones an engine looks at.
ENDPOINT_VAR = "KVSIDECAR_ENDPOINT"
INSTANCE_VAR = "KVSIDECAR_INSTANCE"
RUNTIME_DIR_VAR = "KVSIDECAR_RUNTIME_DIR"
# Read by engines (and `kvsidecar stats`) only; the daemon's configuration
# leaves them alone.
CURVE_SERVER_KEY_VAR = "KVSIDECAR_CURVE_SERVER_KEY"
"""A file holding the sidecar's CURVE public key (its `.key` from `kvsidecar keygen`)."""
CURVE_CLIENT_KEY_VAR = "KVSIDECAR_CURVE_CLIENT_KEY"
"""A file holding this client's CURVE key pair (its `.key_secret`)."""
CLIENT_ONLY_VARS = (CURVE_SERVER_KEY_VAR, CURVE_CLIENT_KEY_VAR)


@dataclass(frozen=True)
class InstancePaths:
    runtime_dir: Path
    instance: str

    @property
    def lock_path(self) -> Path:
        return self.runtime_dir / f"{self.instance}.lock"

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / f"{self.instance}.sock"

    @property
    def admin_token_path(self) -> Path:
        """The admin token: read by `kvsidecar clear` (owner-only: 0600)."""
        return self.runtime_dir / f"{self.instance}.admin"

    @property
    def default_endpoint(self) -> str:
        return f"ipc://{self.socket_path}"

    @property
    def shm_prefix(self) -> str:
        """Prefix of this instance's shm segment names: unique per user,
        instance name and runtime directory (the scope of the lock)."""
        where = hashlib.blake2b(os.path.realpath(self.runtime_dir).encode(), digest_size=4)
        return f"kvsidecar.{os.getuid()}.{self.instance}.{where.hexdigest()}"


def default_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "kvsidecar"
    return Path(f"/tmp/kvsidecar-{os.getuid()}")


def check_own_dir(path: Path) -> None:
    """ValueError unless `path` is missing or a directory of this user that
    no one else may write to. The default runtime directory falls back to
    /tmp, where anyone may create it first and serve a sidecar of their own
    there: an engine would send it its KV and load what it chose."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    problem = None
    if not os.path.isdir(path) or os.path.islink(path):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    elif st.st_mode & 0o022:
        problem = f"may be written by others (mode {st.st_mode & 0o777:o})"
    if problem is not None:
        raise ValueError(
            f"{path}, the default runtime directory, {problem}: it may hold another "
            f"user's sidecar. Set ${RUNTIME_DIR_VAR} (or $XDG_RUNTIME_DIR) to the "
            "sidecar's directory"
        )


def instance_paths(runtime_dir: str | None, instance: str) -> InstancePaths:
    return InstancePaths(Path(runtime_dir) if runtime_dir else default_runtime_dir(), instance)


def default_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """The endpoint of the sidecar an engine connects to by default: the
    daemon's default for the same KVSIDECAR_ENDPOINT, KVSIDECAR_INSTANCE and
    KVSIDECAR_RUNTIME_DIR. Raises ValueError naming a variable that is set
    to something the daemon would refuse."""
    env = os.environ if environ is None else environ
    endpoint = _optional(env.get(ENDPOINT_VAR))
    if endpoint is not None:
        if not endpoint.startswith(ENDPOINT_PREFIXES):
            allowed = ", ".join(ENDPOINT_PREFIXES)
            raise ValueError(f"${ENDPOINT_VAR}={endpoint!r} must start with one of {allowed}")
        return endpoint
    instance = env.get(INSTANCE_VAR, DEFAULT_INSTANCE)
    if not re.fullmatch(INSTANCE_PATTERN, instance):
        raise ValueError(f"${INSTANCE_VAR}={instance!r} does not match {INSTANCE_PATTERN}")
    runtime_dir = _optional(env.get(RUNTIME_DIR_VAR))
    if runtime_dir is not None and not runtime_dir.startswith("/"):
        raise ValueError(f"${RUNTIME_DIR_VAR}={runtime_dir!r} must be an absolute path")
    paths = instance_paths(runtime_dir, instance)
    if runtime_dir is None:  # a directory nobody named: it must be ours
        check_own_dir(paths.runtime_dir)
    return paths.default_endpoint


def _optional(text: str | None) -> str | None:
    """Unset, empty or "none" mean the default, as for the daemon's optional keys."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    return text


def is_loopback(endpoint: str) -> bool:
    """Whether only this host can reach `endpoint`: any ipc://, or a tcp://
    host that is localhost or in 127.0.0.0/8 or ::1. A wildcard (`*`,
    0.0.0.0, ::), an interface name or any other name is not."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CurveClientKeys(NamedTuple):
    """What a client needs to talk to a sidecar that requires CURVE (Z85 keys)."""

    server: bytes
    """The sidecar's public key."""
    public: bytes
    secret: bytes


def load_curve_client_keys(
    server_key_file: str | os.PathLike[str], client_key_file: str | os.PathLike[str]
) -> CurveClientKeys:
    """The keys in ZeroMQ certificate files: the sidecar's public key (its
    `.key` or `.key_secret`) and this client's key pair (its `.key_secret`).
    ValueError naming a file that cannot be read or lacks its key."""
    try:
        server, _ = zmq.auth.load_certificate(server_key_file)
        public, secret = zmq.auth.load_certificate(client_key_file)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load a CURVE key: {err}") from None
    if secret is None:
        raise ValueError(
            f"{os.fspath(client_key_file)} holds no secret key: "
            "give the client's .key_secret file, not its .key"
        )
    return CurveClientKeys(server, public, secret)


def curve_client_keys(environ: Mapping[str, str] | None = None) -> CurveClientKeys | None:
    """The keys named by KVSIDECAR_CURVE_SERVER_KEY and KVSIDECAR_CURVE_CLIENT_KEY
    (None if neither is set); ValueError if only one is, or a file is bad."""
    env = os.environ if environ is None else environ
    server = _optional(env.get(CURVE_SERVER_KEY_VAR))
    client = _optional(env.get(CURVE_CLIENT_KEY_VAR))
    if server is None and client is None:
        return None
    if server is None or client is None:
        raise ValueError(
            f"set both ${CURVE_SERVER_KEY_VAR} and ${CURVE_CLIENT_KEY_VAR}, or neither"
        )
    return load_curve_client_keys(server, client)


def apply_curve(sock: zmq.Socket[bytes], keys: CurveClientKeys) -> None:
    """Make `sock` a CURVE client with `keys` (before it connects)."""
    sock.curve_serverkey = keys.server
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
