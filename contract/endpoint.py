"""Where a sidecar instance listens, and the names of what it owns on the host.

Everything follows from (user, runtime directory, instance name): the
socket `<runtime_dir>/<instance>.sock`, the lock `<runtime_dir>/<instance>.lock`
and the shm segment prefix. The daemon (`sidecar.runtime`) creates them; an
engine finds the default endpoint here from three environment variables,
without loading the daemon's configuration.

The shm names include a digest of the runtime directory: two sidecars of one
instance name with different runtime directories (one started with
XDG_RUNTIME_DIR set, one without) hold different locks, and must not take
each other's segments for leftovers.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_INSTANCE = "default"
INSTANCE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
ENDPOINT_PREFIXES = ("ipc://", "tcp://")

# The daemon's configuration keys of the same names (sidecar.config) read the
# same variables; these are the only ones an engine looks at.
ENDPOINT_VAR = "KVSIDECAR_ENDPOINT"
INSTANCE_VAR = "KVSIDECAR_INSTANCE"
RUNTIME_DIR_VAR = "KVSIDECAR_RUNTIME_DIR"


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
    return instance_paths(runtime_dir, instance).default_endpoint


def _optional(text: str | None) -> str | None:
    """Unset, empty or "none" mean the default, as for the daemon's optional keys."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    return text
