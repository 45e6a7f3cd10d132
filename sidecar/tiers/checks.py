"""The lower tiers' settings, checked at start before anything is bound.

The SSD and remote tiers are built when the first engine registers (their
slots are sized by its block layout), so a bad `ssd_dirs` or `remote_url`
would only show then, as a tier silently left out. `check_tiers` finds them
at start instead, raising ConfigError naming the key and value: every SSD
directory exists or can be created, is a directory, is writable, is not
on a pseudo filesystem and is not listed twice (under any path); the
remote URL parses and the secret file holds a secret. A store that is down
is not an error: it only marks the tier unavailable until it answers (as
at any time).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from redis.connection import parse_url

from sidecar.config import Config, ConfigError, format_size
from sidecar.tiers.remote.value_check import read_secret

log = logging.getLogger("kvsidecar")

PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")
"""Where no block may be stored (`/dev/shm` aside: a RAM tier is `shm_dir`'s)."""


def check_tiers(config: Config) -> None:
    """Raise ConfigError for the first tier setting that cannot work; log a
    warning for a remote tier without a secret."""
    seen: dict[str, str] = {}
    for d in config.ssd_dirs:
        problem = _ssd_dir_problem(d)
        if problem is not None:
            raise ConfigError(f"ssd_dirs: {d!r} {problem}")
        real = os.path.realpath(d)
        if real in seen:  # its files would be locked against themselves
            raise ConfigError(f"ssd_dirs: {d!r} is the directory {seen[real]!r} again")
        seen[real] = d
    if config.remote_url is not None:
        problem = _url_problem(config.remote_url)
        if problem is not None:
            raise ConfigError(f"remote_url {redact(config.remote_url)!r} {problem}")
    if config.remote_secret_file is not None:
        read_secret(config.remote_secret_file)
    elif config.remote_url is not None:
        log.warning(
            "remote tier without remote_secret_file: its values carry a checksum, not a MAC, "
            "so anyone who can write to %s can make engines load bytes of their choosing; "
            "that store must be fully trusted",
            redact(config.remote_url),
        )


def describe_tiers(config: Config) -> list[str]:
    """One phrase per lower tier configured, for the start-up line."""
    out = []
    if config.ssd_dirs:
        out.append(
            f"SSD tier {len(config.ssd_dirs)} x {format_size(config.ssd_capacity_per_dir)} "
            f"in {', '.join(config.ssd_dirs)}"
        )
    if config.remote_url is not None:
        check = "MAC" if config.remote_secret_file is not None else "checksum only, no secret"
        out.append(
            f"remote tier {redact(config.remote_url)}"
            f"{' (cluster)' if config.remote_cluster else ''}, "
            f"namespace {config.remote_namespace!r} ({check})"
        )
    return out


def redact(url: str) -> str:
    """The URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}@" if parts.username else ""
    return parts._replace(netloc=user + host).geturl()


def _ssd_dir_problem(path: str) -> str | None:
    real = Path(os.path.realpath(path))
    for pseudo in PSEUDO_FILESYSTEMS:
        if real.is_relative_to(pseudo) and not real.is_relative_to("/dev/shm"):
            return f"is under {pseudo}, not on a disk"
    if real.exists():
        if not real.is_dir():
            return "exists and is not a directory"
        try:  # a real probe: root passes every permission check but a read-only mount's
            with tempfile.TemporaryFile(dir=real):
                pass
        except OSError as err:
            return f"is not writable: {err.strerror}"
        return None
    parent = real.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"does not exist and cannot be created ({parent} is not a writable directory)"
    return None


def _url_problem(url: str) -> str | None:
    try:
        options = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as err:
        return f"cannot be used: {err}"
    if url.startswith("unix://") and not options.get("path"):
        return "names no socket path (unix:///path/to/redis.sock)"
    db = urlsplit(url).path.strip("/")
    if not url.startswith("unix://") and db and not db.isdigit():
        return f"names database {db!r}; allowed: a number (redis://host:port/0)"
    return None
