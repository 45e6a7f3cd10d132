"""The sidecar's configuration: one frozen dataclass, loaded in layers.

Load order, later layers winning key by key:

    defaults < YAML/JSON file < environment (KVSIDECAR_<KEY>) < explicit overrides

This is the only module that reads `KVSIDECAR_` variables (sidecar/runtime.py
reads XDG_RUNTIME_DIR for the default runtime directory); everything else
receives a `Config` (or values taken from it). Keys are flat, so FlexKV's
eviction section (`eviction_policy`, `evict_start_threshold`, `evict_ratio`,
`hit_reward_seconds`) loads unchanged from a FlexKV yml/json file. Tokens per
block and the block-key hash are not sidecar settings: each engine gives them
to `KVClient.register`, along with the rest of its block-key namespace.

Every key is one dataclass field whose metadata holds a `FieldSpec`: its doc
line, type and allowed values. Validation, environment parsing and the table in
docs/configuration.md are all driven by those specs, so adding a key means
adding one field. `python -m sidecar.config --markdown` prints that table.
"""

from __future__ import annotations

import argparse
import difflib
import grp
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from contract.endpoint import (
    CLIENT_ONLY_VARS,
    DEFAULT_INSTANCE,
    ENDPOINT_PREFIXES,
    INSTANCE_PATTERN,
    is_loopback,
)
from sidecar.config_spec import (
    SPEC,
    ConfigError,
    FieldSpec,
    config_key,
    format_size,
    parse_size,
)
from sidecar.control.policies import DEFAULT_POLICY, POLICY_NAMES
from sidecar.namespace_limits import parse_rules

__all__ = [
    "SPECS",
    "Config",
    "ConfigError",
    "FieldSpec",
    "config_table_markdown",
    "env_var",
    "format_size",
    "group_id",
    "load_client_config",
    "load_config",
    "parse_overrides",
    "parse_size",
]

ENV_PREFIX = "KVSIDECAR_"
CONFIG_VAR = "KVSIDECAR_CONFIG"
"""Names the config file when none is given (`kvsidecar serve --config` wins)."""
_NOT_KEYS = frozenset((CONFIG_VAR, *CLIENT_ONLY_VARS))
"""KVSIDECAR_ variables that are not configuration keys."""
_warned_variables: set[str] = set()
ENDPOINT_KEYS = ("endpoint", "events_endpoint", "events_resync_endpoint")
"""The keys naming a socket the sidecar binds."""

log = logging.getLogger("kvsidecar")


_MiB = 2**20
_GiB = 2**30


@dataclass(frozen=True)
class Config:
    """Every setting of the sidecar, validated and normalised on construction.

    Sizes are stored as int bytes, floats as float (an int is accepted), lists as
    tuples of str. Constructing one with a bad value (directly or through
    `dataclasses.replace`) raises ConfigError. Build it with `load_config`.
    """

    eviction_policy: str = config_key(
        DEFAULT_POLICY,
        "str",
        "Which unlocked, ready leaves are evicted first.",
        choices=POLICY_NAMES,
    )
    evict_start_threshold: float = config_key(
        0.95,
        "float",
        "Tier utilisation at which eviction starts.",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    evict_ratio: float = config_key(
        0.01,
        "float",
        "Minimum share of a tier's capacity evicted at once (0 = only what is needed).",
        low=0.0,
        high=1.0,
    )
    hit_reward_seconds: float = config_key(
        0.0,
        "float",
        "lru only: each hit adds this many seconds to a block's effective access time, "
        "cumulatively.",
        low=0.0,
    )
    cpu_capacity: int | None = config_key(
        None,
        "size",
        "CPU (shared-memory) tier capacity; None lets the daemon pick 10% of RAM (or of the "
        "cgroup's memory limit, if lower), at most 16GiB, at least 64MiB.",
        low=_MiB,
        optional=True,
    )
    cpu_extent_size: int | None = config_key(
        None,
        "size",
        "Unit in which block geometries (models) share the CPU tier: its shm segments. None = "
        "capacity/16, between 4MiB and 256MiB (and at most the capacity); a block must fit one.",
        low=_MiB,
        optional=True,
    )
    shm_dir: str | None = config_key(
        None,
        "str",
        "Directory on a hugetlbfs or huge=always tmpfs mount for the CPU tier (huge pages "
        "double O_DIRECT reads); engines must see the same path. None = POSIX shm (/dev/shm).",
        prefixes=("/",),
        optional=True,
    )
    ssd_dirs: tuple[str, ...] = config_key(
        (), "str_list", "SSD tier directories, blocks striped across them; empty = SSD tier off."
    )
    ssd_capacity_per_dir: int = config_key(
        64 * _GiB, "size", "SSD tier capacity of each directory.", low=_MiB
    )
    ssd_extent_size: int | None = config_key(
        None,
        "size",
        "Unit in which block geometries (models) share the SSD tier, per directory. None = "
        "ssd_capacity_per_dir in up to 64 equal extents of at least 64MiB (more, if one "
        "would exceed 4GiB); a geometry whose block does not fit one has no SSD tier.",
        low=_MiB,
        optional=True,
    )
    ssd_io_threads: int = config_key(
        4, "int", "Threads reading and writing the SSD tier.", low=1, high=64
    )
    remote_url: str | None = config_key(
        None,
        "str",
        "Redis/Valkey URL of the remote tier; None = remote tier off.",
        prefixes=("redis://", "rediss://", "unix://"),
        optional=True,
    )
    remote_capacity: int = config_key(
        1024 * _GiB,
        "size",
        "Bytes of blocks the remote index assumes it may hold (at most 1M blocks).",
        low=_MiB,
    )
    remote_cluster: bool = config_key(
        False, "bool", "remote_url is one node of a Redis Cluster: use the cluster client."
    )
    remote_namespace: str = config_key(
        "kvsidecar",
        "str",
        "Prefix of every remote key (<namespace>:<block key>); separates deployments "
        "sharing a store.",
        pattern=r"[A-Za-z0-9_.:{}-]{1,64}",
    )
    remote_secret_file: str | None = config_key(
        None,
        "str",
        "File holding the deployment's secret (at least 16 bytes, the same on every host): "
        "remote values carry an HMAC-SHA256 under it, and values forged or written without it "
        "are misses. None = a checksum only: the store must be fully trusted (logged).",
        optional=True,
    )
    remote_io_threads: int = config_key(
        4,
        "int",
        "Threads (each with its own connection) running remote reads and writes.",
        low=1,
        high=64,
    )
    remote_write_streams: int = config_key(
        1,
        "int",
        "Connections one remote write (an H2REMOTE op) is spread over (at most "
        "remote_io_threads, else a config error); reads use every thread. One pipelined stream per "
        "server wrote fastest to one Redis on a 2-core host (docs/sidecar.md); "
        "raise it where round trips, not bytes, bound the writes (a far store).",
        low=1,
        high=64,
    )
    remote_timeout_seconds: float = config_key(
        0.5,
        "float",
        "Bound on each remote connect, send and reply; past it the tier is marked unavailable.",
        low=0.01,
        high=60.0,
    )
    remote_retry_seconds: float = config_key(
        1.0,
        "float",
        "First wait before an unavailable remote tier is tried again (doubling after each "
        "failed try).",
        low=0.01,
        high=3600.0,
    )
    remote_retry_max_seconds: float = config_key(
        30.0, "float", "Longest wait between tries of an unavailable remote tier.", low=0.01
    )
    remote_put_quota_blocks: int = config_key(
        256,
        "int",
        "Remote writes in flight at most, in blocks; blocks past it are DENIED (not written, "
        "counted).",
        low=0,
    )
    remote_double_get_min_blocks: int = config_key(
        4,
        "int",
        "Ask the remote tier only when at least this many blocks are missing locally.",
        low=1,
    )
    remote_double_get_min_share: float = config_key(
        0.1,
        "float",
        "... and the missing blocks are at least this share of the request.",
        low=0.0,
        high=1.0,
    )
    write_policy: str = config_key(
        "write_through",
        "str",
        "When blocks saved to the CPU tier are also written to SSD / remote.",
        choices=("write_through", "write_through_selective", "write_back"),
    )
    write_through_min_hits: int = config_key(
        2, "int", "write_through_selective only: CPU hits before a block is written down.", low=1
    )
    hit_window: int = config_key(
        1000, "int", "Number of recent requests in the sliding-window hit ratio.", low=1
    )
    instance: str = config_key(
        DEFAULT_INSTANCE,
        "str",
        "Instance name: one sidecar per name and user; names its socket, lock and shm segments.",
        pattern=INSTANCE_PATTERN,
    )
    runtime_dir: str | None = config_key(
        None,
        "str",
        "Absolute path of the directory for the socket and lock: created with mode 0700 "
        "(0750 with group) if missing; an existing one must be ours, not a symlink, and "
        "writable by no one else. "
        "None = $XDG_RUNTIME_DIR/kvsidecar, else /tmp/kvsidecar-<uid>.",
        prefixes=("/",),
        optional=True,
    )
    group: str | None = config_key(
        None,
        "name_or_id",
        "Unix group (name or gid) whose members' engines may use this sidecar: the runtime "
        "directory it creates is 0750, the ipc socket and the shm segments 0660 (the hot "
        "indexes, which engines only read, 0640), all of this group; the lock and key files "
        "stay owner-only. Any member can read and write every cached block. None = the owner "
        "only (a 0700 directory, 0600 segments).",
        pattern=r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}",
        optional=True,
    )
    endpoint: str | None = config_key(
        None,
        "str",
        "ZeroMQ endpoint to serve: ipc://PATH or tcp://HOST:PORT (1 <= PORT <= 65535; off "
        "loopback, or an abstract ipc://@name, only with allow_remote_endpoints); "
        "None = ipc://<runtime_dir>/<instance>.sock.",
        prefixes=ENDPOINT_PREFIXES,
        optional=True,
    )
    max_geometries: int = config_key(
        32,
        "int",
        "Block geometries (layers x block bytes x TP size) the sidecar serves at most: each "
        "has its tiers, hot index, I/O threads and files for the sidecar's life. A register "
        "of one more is refused.",
        low=1,
        high=1024,
    )
    max_namespaces: int = config_key(
        65536,
        "int",
        "Namespaces (model, revision, tenant) the sidecar tracks at most; a register of one "
        "more is refused.",
        low=1,
        high=2**24,
    )
    lease_seconds: float = config_key(
        10.0,
        "float",
        "An engine that has not been heard from for this long is dropped: its locks "
        "released, its unfinished saves discarded.",
        low=0.1,
        high=3600.0,
    )
    busy_poll_us: int = config_key(
        0,
        "int",
        "After serving a request the loop polls without sleeping for this many "
        "microseconds before it blocks, so an engine's next request is served "
        "without a wake-up (~100-250 us on a VM). Costs a core within that window "
        "after traffic: worth it where cores are spare; 0 = always block. At most "
        "an eighth of lease_seconds is used.",
        low=0,
        high=1_000_000,
    )
    drain_seconds: float = config_key(
        5.0, "float", "On SIGTERM, how long in-flight plans may take to finish.", low=0.0
    )
    metrics_port: int | None = config_key(
        None,
        "int",
        "Port of the metrics endpoint (Prometheus /metrics, /healthz, /readyz) on "
        "metrics_host; None = off.",
        low=1,
        high=65535,
        optional=True,
    )
    metrics_host: str = config_key(
        "127.0.0.1",
        "str",
        "Address the metrics endpoint binds. It is read-only, so any address may be "
        "set (0.0.0.0 for a scraper on another host), but it shows the cache's "
        "use and the engines' traffic to whoever can reach it.",
        pattern=r"[0-9A-Za-z.:_-]+",
    )
    prefault: bool = config_key(
        True, "bool", "Touch every page of the CPU tier at start (first touch is ~16x slower)."
    )
    events_endpoint: str | None = config_key(
        None,
        "str",
        "ZMQ PUB endpoint (bound) publishing the CPU tier's KV events to cluster routers; "
        "None = off.",
        prefixes=("tcp://", "ipc://"),
        optional=True,
    )
    events_resync_endpoint: str | None = config_key(
        None,
        "str",
        "ZMQ ROUTER endpoint (bound) answering a router's resync request with a full dump; "
        "needs events_endpoint.",
        prefixes=("tcp://", "ipc://"),
        optional=True,
    )
    allow_remote_endpoints: bool = config_key(
        False,
        "bool",
        "Allow tcp:// endpoints off loopback (anything but 127.0.0.0/8, ::1, localhost), "
        "which then need curve_secret_key_file and curve_authorized_keys_dir, and abstract "
        "ipc://@name endpoints, which any local user may connect to (no CURVE, no group).",
    )
    curve_secret_key_file: str | None = config_key(
        None,
        "str",
        "The sidecar's CURVE key pair (a .key_secret file from kvsidecar keygen, mode 0600): "
        "when set, every tcp:// socket it binds requires CURVE; None = no CURVE.",
        optional=True,
    )
    curve_authorized_keys_dir: str | None = config_key(
        None,
        "str",
        "Directory of the public keys (*.key files) of the clients allowed to connect over "
        "CURVE; needed with curve_secret_key_file.",
        optional=True,
    )
    events_worker_id: int = config_key(
        0,
        "int",
        "This sidecar's worker id in its KV events (unique per cluster).",
        low=0,
        high=2**63 - 1,  # a msgpack int64: larger ids would fail at the first publish
    )

    namespace_limits: tuple[str, ...] = config_key(
        (),
        "str_list",
        "Per-namespace limits, one entry each: a selector (model=, revision=, tenant=; left out: "
        "any) and limits (cpu=, ssd=, remote= sizes; ttl= seconds), space-separated, e.g. "
        "'tenant=trial cpu=512MiB ttl=600'. Matching entries apply in order.",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            # The documented way to normalise a field of a frozen dataclass.
            object.__setattr__(
                self, f.name, f.metadata[SPEC].convert(f.name, getattr(self, f.name))
            )
        if self.events_resync_endpoint is not None and self.events_endpoint is None:
            raise ConfigError(
                "events_resync_endpoint is set but events_endpoint is not: set both, or neither"
            )
        if self.remote_write_streams > self.remote_io_threads:
            raise ConfigError(
                f"remote_write_streams ({self.remote_write_streams}) must not exceed "
                f"remote_io_threads ({self.remote_io_threads}): each stream is one thread"
            )
        self._check_endpoints()
        try:
            parse_rules(self.namespace_limits)
        except ValueError as err:
            raise ConfigError(f"namespace_limits: {err}") from None
        bound = [e for e in (getattr(self, key) for key in ENDPOINT_KEYS) if e]
        if len(set(bound)) != len(bound):
            raise ConfigError(
                "endpoint, events_endpoint and events_resync_endpoint must all differ "
                f"(each is bound by its own socket), got {bound}"
            )

    def _check_endpoints(self) -> None:
        """A tcp:// endpoint names a port, and one off loopback is bound only
        when allowed, and then only with CURVE. An abstract ipc://@name socket
        has no file permissions (any local user may connect, `group` cannot
        narrow that, and CURVE covers tcp:// only): bound only when allowed.
        A client's configuration (`load_client_config`) binds nothing: only
        the ports are checked."""
        if not _BINDS.get():
            for key in ENDPOINT_KEYS:
                value = getattr(self, key)
                if value is not None and value.startswith("tcp://"):
                    _check_tcp_port(key, value)
            return
        if (self.curve_secret_key_file is None) != (self.curve_authorized_keys_dir is None):
            raise ConfigError(
                "curve_secret_key_file and curve_authorized_keys_dir go together: set both "
                "(kvsidecar keygen makes the key files), or neither"
            )
        for key in ENDPOINT_KEYS:
            value = getattr(self, key)
            if value is None:
                continue
            if value.startswith("tcp://"):
                _check_tcp_port(key, value)
            if value.startswith("ipc://@") and not self.allow_remote_endpoints:
                raise ConfigError(
                    f"{key} {value!r} is an abstract unix socket: it has no file permissions, "
                    "so any local user could connect to it (group cannot restrict it); use "
                    "ipc://PATH (a socket file in a private directory), or set "
                    "allow_remote_endpoints=true to accept that"
                )
            if is_loopback(value):
                continue
            if not self.allow_remote_endpoints:
                raise ConfigError(
                    f"{key} {value!r} is not on loopback (127.0.0.0/8, ::1, localhost): "
                    "anyone who reaches it could drive this sidecar; bind 127.0.0.1, or set "
                    "allow_remote_endpoints=true with CURVE keys (curve_secret_key_file, "
                    "curve_authorized_keys_dir)"
                )
            if self.curve_secret_key_file is None:
                raise ConfigError(
                    f"{key} {value!r} is off loopback: it needs CURVE, so set "
                    "curve_secret_key_file and curve_authorized_keys_dir "
                    "(kvsidecar keygen makes the key files)"
                )

    def to_dict(self) -> dict[str, object]:
        """Plain values (lists, not tuples) that `load_config` accepts back."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def group_id(group: str | None) -> int | None:
    """The gid the `group` key names: digits are a gid as they are (a
    container may know a gid without a name for it), anything else a group
    name looked up in the host's group database. None for None; ConfigError
    naming the key for an unknown name or an impossible gid.

    Called where the group is used (the daemon's start), not by `Config`:
    a configuration loads the same on any host."""
    if group is None:
        return None
    if group.isdigit():
        gid = int(group)
        if gid >= 2**32 - 1:  # (gid_t)-1 means "leave unchanged" to chown
            raise ConfigError(f"group: gid {gid} is out of range; allowed: 0 <= gid < 4294967295")
        return gid
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"group: {group!r} names no group on this host (getent group {group}); "
            "allowed: an existing group name or a numeric gid"
        ) from None


def _check_tcp_port(key: str, endpoint: str) -> None:
    """ConfigError unless `endpoint` (tcp://HOST:PORT) names a host and a port
    in 1..65535: ZeroMQ would take 0 or * for "any free port" (which engines
    cannot find) and a larger number modulo 65536."""
    host, colon, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not (colon and host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(
            f"{key}: {endpoint!r} is not tcp://HOST:PORT with 1 <= PORT <= 65535 "
            "(a fixed port: engines must know where to connect)"
        )


SPECS: dict[str, FieldSpec] = {f.name: f.metadata[SPEC] for f in fields(Config)}
"""Key name -> its spec, in declaration order."""


def env_var(key: str) -> str:
    """The environment variable that sets `key`: KVSIDECAR_<KEY>."""
    return ENV_PREFIX + key.upper()


# --- loading -------------------------------------------------------------------


_BINDS: ContextVar[bool] = ContextVar("binds", default=True)
"""Whether the configuration being made is a server's (its endpoints bound)."""


def load_client_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """`load_config` for a client of a sidecar (`kvsidecar status`, `stats`,
    `namespaces`, `clear`): it connects to the endpoint, binding nothing,
    so the rules for binding one (loopback unless allowed, then with CURVE
    server keys; no abstract names) do not apply. Off loopback it needs
    the engines' CURVE client keys (`KVSIDECAR_CURVE_SERVER_KEY`,
    `KVSIDECAR_CURVE_CLIENT_KEY`), as an engine does."""
    token = _BINDS.set(False)
    try:
        return load_config(path, env, overrides)
    finally:
        _BINDS.reset(token)


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Defaults, then the file at `path` (None: the file $KVSIDECAR_CONFIG
    names, if set), then `env`, then `overrides`.

    `env=None` reads `os.environ`; only variables starting with KVSIDECAR_ are
    looked at (but KVSIDECAR_CONFIG and the clients' CURVE keys,
    `contract.endpoint.CLIENT_ONLY_VARS`). One that names no key is logged as
    a warning, once per process, and ignored: deployments set such variables
    of their own (Kubernetes: `KVSIDECAR_SERVICE_HOST`, `KVSIDECAR_PORT`, ...
    for a Service named kvsidecar).
    File and override values must already have the key's type; environment
    strings are parsed. Raises ConfigError, naming the source, key and value.
    """
    values: dict[str, Any] = {}
    environ = os.environ if env is None else env
    named = environ.get(CONFIG_VAR, "").strip()
    if path is None and named:
        with _blame(f"${CONFIG_VAR}"):
            values.update(_convert_all(_read_file(Path(named)), f"config file {named!r}"))
    elif path is not None:
        values.update(_convert_all(_read_file(Path(path)), f"config file {os.fspath(path)!r}"))
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_KEYS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in SPECS:
            _warn_unknown_variable(name, key)
            continue
        with _blame(f"${name}"):
            values[key] = SPECS[key].convert_env(key, text)
    if overrides is not None:
        values.update(_convert_all(overrides, "overrides"))
    return Config(**values)


def _warn_unknown_variable(name: str, key: str) -> None:
    """Once per variable and process: the deployment may set KVSIDECAR_*
    variables of its own (Kubernetes names a Service's host and port so)."""
    if name in _warned_variables:
        return
    _warned_variables.add(name)
    near = difflib.get_close_matches(key, SPECS, n=1)
    hint = f" (did you mean ${env_var(near[0])}, key {near[0]!r}?)" if near else ""
    log.warning("$%s names no configuration key: ignored%s", name, hint)


def parse_overrides(pairs: Sequence[str], source: str = "--set") -> dict[str, object]:
    """`KEY=VALUE` strings (as on a command line), parsed like environment
    values; errors name `source` (the flag the pairs came from)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ConfigError(f"override {pair!r} is not KEY=VALUE")
        key = key.strip().replace("-", "_")
        with _blame(source):
            values[key] = _spec_of(key).convert_env(key, text)
    return values


def _convert_all(raw: Mapping[Any, object], source: str) -> dict[str, object]:
    with _blame(source):
        return {key: _spec_of(key).convert(key, value) for key, value in raw.items()}


@contextmanager
def _blame(source: str) -> Iterator[None]:
    """Prefix a ConfigError raised inside with the source it came from."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _spec_of(key: object) -> FieldSpec:
    if isinstance(key, str) and key in SPECS:
        return SPECS[key]
    near = difflib.get_close_matches(str(key), SPECS, n=1)
    if near:
        raise ConfigError(f"unknown key {key!r} (did you mean {near[0]!r}?)")
    raise ConfigError(f"unknown key {key!r}; allowed: {', '.join(SPECS)}")


def _load_yaml(text: str) -> object:
    data = yaml.safe_load(text)
    # An empty or all-comments file is an empty configuration, not an error.
    return {} if data is None else data


_LOADERS: dict[str, Callable[[str], object]] = {
    ".yml": _load_yaml,
    ".yaml": _load_yaml,
    ".json": json.loads,
}


def _read_file(path: Path) -> Mapping[Any, object]:
    where = f"config file {str(path)!r}"
    suffix = path.suffix.lower()
    if suffix not in _LOADERS:
        raise ConfigError(
            f"{where}: extension {suffix!r} is not allowed; allowed: .yml, .yaml, .json"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{where} does not exist; allowed: an existing .yml, .yaml or .json file"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} cannot be read: {err}") from None
    try:
        data = _LOADERS[suffix](text)
    except (yaml.YAMLError, ValueError) as err:
        raise ConfigError(f"{where} is not valid {suffix[1:].upper()}: {err}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}: top level is {type(data).__name__} {data!r}; allowed: a key: value mapping"
        )
    return data


# --- documentation -------------------------------------------------------------


def config_table_markdown() -> str:
    """The Markdown table of every key, as docs/configuration.md embeds it."""
    lines = [
        "| key | type | default | allowed | env var | description |",
        "|---|---|---|---|---|---|",
    ]
    for f in fields(Config):
        spec: FieldSpec = f.metadata[SPEC]
        cells = (
            f"`{f.name}`",
            spec.type_name,
            f"`{spec.render(f.default)}`",
            spec.allowed(f.name),
            f"`{env_var(f.name)}`",
            spec.doc,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.config",
        description="Print the effective configuration as JSON, or the docs table.",
    )
    parser.add_argument("path", nargs="?", help="config file (.yml/.yaml/.json) to load")
    parser.add_argument(
        "--markdown", action="store_true", help="print the key table of docs/configuration.md"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(config_table_markdown(), end="")
    else:
        try:
            config = load_config(args.path)
        except ConfigError as err:
            parser.error(str(err))
        print(json.dumps(config.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
