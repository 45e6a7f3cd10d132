"""`kvsidecar` command line. Subcommands register themselves here."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsidecar import logs
from sidecar.config import (
    Config,
    ConfigError,
    format_size,
    load_client_config,
    load_config,
    parse_overrides,
)

if TYPE_CHECKING:
    from sidecar.cleanup import Removed


HEAVY_COMMANDS = ("demo", "bench", "router", "analyze")
"""Commands whose parsers import their modules (the benchmarks import
torch): registered only when the command line may need them, so that
`kvsidecar serve` starts without torch (~1 s less here)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser. `command` (the subcommand about to be
    parsed) leaves out the heavy commands it is not; None, or a command this
    parser does not know, keeps them all (help, and errors listing choices)."""
    parser = argparse.ArgumentParser(
        prog="kvsidecar",
        description="Per-host KV-cache offloading sidecar for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_serve(sub)
    for name, help_text in (
        ("status", "one-line summary of a running sidecar"),
        ("stats", "every figure a running sidecar reports"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        _config_args(p)
        p.add_argument(
            "--timeout", type=timeout_seconds, default=2.0, help="seconds to wait (default 2)"
        )
        if name == "stats":
            p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=_status if name == "status" else _stats)
    _add_cleanup(sub)
    from kvsidecar.admin import add_parsers as add_admin_parsers

    add_admin_parsers(sub, _config_args, _fetch, _load_client, timeout_seconds)
    keygen = sub.add_parser(
        "keygen",
        help="make a CURVE key pair for a sidecar or a client (DIR/NAME.key, NAME.key_secret)",
        description="Make a ZeroMQ CURVE key pair: NAME.key (the public key, to hand out: "
        "into the sidecar's curve_authorized_keys_dir for a client, to clients as "
        "KVSIDECAR_CURVE_SERVER_KEY for a sidecar) and NAME.key_secret (mode 0600: the "
        "sidecar's curve_secret_key_file, or a client's KVSIDECAR_CURVE_CLIENT_KEY).",
    )
    keygen.add_argument("dir", metavar="DIR", help="directory to write into (made 0700 if missing)")
    keygen.add_argument(
        "--name",
        type=key_name,
        default="kvsidecar",
        help="file name stem: no '/', no leading '.' (default kvsidecar)",
    )
    keygen.set_defaults(func=_keygen)
    if command is not None and command in sub.choices:
        return parser
    every = command not in HEAVY_COMMANDS
    if every or command == "demo":
        from kvsidecar.demo import add_parser as add_demo_parser

        add_demo_parser(sub)
    if every or command == "bench":
        from bench.cli import add_bench_parser

        add_bench_parser(sub)
    if every or command == "router":
        from router.cli import add_parsers as add_router_parsers

        add_router_parsers(sub)
    if every or command == "analyze":
        from cachesim.analyze import add_arguments as add_analyze_arguments

        help_text = "prefix-reuse analysis of a Mooncake trace, with a hit ratio vs cache size plot"
        add_analyze_arguments(sub.add_parser("analyze", help=help_text))
    return parser


def _version() -> str:
    """The installed distribution's version (package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvsidecar")
    except PackageNotFoundError:
        return "(not installed: no package metadata)"


def key_name(text: str) -> str:
    """An argparse type: the stem of keygen's two file names in DIR. Not
    empty nor starting with "." (the keys would be hidden files), no "/"."""
    if not text or text.startswith(".") or "/" in text or "\0" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a file name stem (not empty, no leading '.', no '/')"
        )
    return text


def timeout_seconds(text: str) -> float:
    """An argparse type: seconds a command waits for the sidecar, a finite
    number in (0, MAX_TIMEOUT], as every client timeout (engine_shim.channel)."""
    from engine_shim.channel import MAX_TIMEOUT, timeout_problem

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if timeout_problem(value) is not None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds in (0, {MAX_TIMEOUT:g}]"
        )
    return value


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML or JSON configuration file")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one configuration key (repeatable); see docs/configuration.md",
    )
    p.add_argument("--instance", help="instance name (default 'default')")
    p.add_argument("--endpoint", help="ipc://PATH or tcp://127.0.0.1:PORT")


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the sidecar daemon (until SIGTERM or Ctrl-C)",
        description="Run the sidecar: defaults < --config FILE < KVSIDECAR_* env < flags.",
    )
    _config_args(p)
    p.add_argument("--cpu-capacity", metavar="SIZE", help="CPU tier size, e.g. 8GiB")
    p.add_argument("--metrics-port", metavar="PORT", help="Prometheus endpoint port")
    p.add_argument(
        "--parent-pid",
        metavar="PID",
        type=int,
        help="stop (as on SIGTERM) once process PID, this sidecar's parent, has exited: "
        "for a sidecar owned by the program that starts it",
    )
    p.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default="warning",
        help="drop log records below this level (default warning); the start-up and stop "
        "lines are always written",
    )
    p.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="text",
        help="text lines, or one JSON object per line (ts, level, logger, message, and the "
        "start-up line's instance, endpoint, pid, tiers); all on stderr (default text)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="at least --log-level info")
    p.set_defaults(func=_serve)


def _add_cleanup(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cleanup",
        help="remove the shm segments, socket and lock file a crashed sidecar of this user left",
        description="Remove the shm segments, socket and lock file that a crashed sidecar "
        "instance of this user left in its runtime directory, printing each and the bytes "
        "freed. The instance (--instance, else the configured one, else 'default') must be "
        "dead: cleanup takes its instance lock as a starting sidecar would, and while a live "
        "process holds it, or accepts on its socket or on its configured endpoints (--endpoint, "
        "events_endpoint, events_resync_endpoint: a lock file can be removed under a live "
        "sidecar), refuses (exit 1) and removes nothing; those endpoints' dead ipc sockets are "
        "removed too. --all does this for every "
        "instance of this user in the runtime directory: live ones are listed and left "
        "alone. Reads the same configuration as serve (runtime_dir, shm_dir).",
    )
    _config_args(p)
    p.add_argument(
        "--all",
        action="store_true",
        help="every dead instance of this user in the runtime directory, not one",
    )
    p.set_defaults(func=_cleanup)


def _load(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """The configuration these flags give, over `env` (None: os.environ)."""
    return load_config(args.config, env, _overrides(args))


def _load_client(args: argparse.Namespace) -> Config:
    """`_load` for a command that connects to a sidecar (`load_client_config`)."""
    return load_client_config(args.config, None, _overrides(args))


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    overrides = parse_overrides(args.set)
    for key in ("instance", "endpoint", "cpu_capacity", "metrics_port"):
        value = getattr(args, key, None)
        if value is not None:
            flag = "--" + key.replace("_", "-")
            overrides.update(parse_overrides([f"{key}={value}"], source=flag))
    return overrides


def _serve(args: argparse.Namespace) -> int:
    """Run the daemon; its every line (start-up, logs, errors, stop) goes to
    stderr in --log-format (kvsidecar/logs.py)."""
    import posix_ipc
    import zmq

    from shm.segments import ShmPoolError
    from sidecar.runtime import InstanceRunning, UnsafeRuntimeDir
    from sidecar.sd_notify import SdNotifier
    from sidecar.server.server import Server
    from sidecar.tiers.checks import describe_tiers

    verbose = args.verbose and args.log_level in ("warning", "error")
    logs.configure("info" if verbose else args.log_level, args.log_format)
    log = logging.getLogger(logs.LOGGER)
    if args.log_level != "error":  # start-up progress shows at the default level too
        start = logging.getLogger("kvsidecar.start")
        start.setLevel(min(logging.INFO, log.getEffectiveLevel()))
    if args.parent_pid is not None and args.parent_pid != os.getppid():
        log.error(
            "--parent-pid %d is not this process's parent (pid %d); has it exited already?",
            args.parent_pid,
            os.getppid(),
        )
        return 2
    try:
        notifier = SdNotifier.from_environ()
        server = Server(_load(args), parent_pid=args.parent_pid, notifier=notifier)
        server.handle_signals()
        server.start()  # undoes what it did before raising
    except ConfigError as err:
        log.error("configuration error: %s", err)
        return 2
    except (InstanceRunning, UnsafeRuntimeDir) as err:
        log.error("%s", err)
        return 1
    # A port in use, no room, another user's file under our shm names, ...
    except (OSError, ShmPoolError, zmq.ZMQError, posix_ipc.Error) as err:
        log.error("cannot start: %s", err)
        return 1
    config, pool = server.config, server.parts.pool
    host = config.metrics_host
    metrics = (
        f"http://{f'[{host}]' if ':' in host else host}:{config.metrics_port}/metrics"
        if config.metrics_port
        else None
    )
    cpu = (
        f"CPU tier {format_size(server.capacity)} in {len(pool.segment_names)} shm segment(s) "
        f"({pool.page_kind} pages), prefaulted in {pool.prefault_seconds:.2f} s"
    )
    tiers = [cpu, *describe_tiers(config)]
    logs.lifecycle(
        f"instance {config.instance!r} (pid {os.getpid()}) serving on {server.endpoint}; "
        + "".join(f"{tier}; " for tier in tiers)
        + f"policy {config.eviction_policy}"
        + (f"; metrics on {metrics}" if metrics else ""),
        {
            "instance": config.instance,
            "endpoint": server.endpoint,
            "pid": os.getpid(),
            "tiers": tiers,
            "cpu_capacity_bytes": server.capacity,
            "eviction_policy": config.eviction_policy,
            "metrics": metrics,
        },
    )
    # What is alive now (modules, the config, the CPU tier's set-up) lives as
    # long as the daemon: kept out of the cyclic collector's scans, a full
    # collection while serving scans only what serving made (one took 23 ms
    # in the first 3,000 one-block saves; docs/sidecar.md, "Garbage collection").
    gc.collect()
    gc.freeze()
    server.serve_forever()
    logs.lifecycle("stopped", {"instance": config.instance, "pid": os.getpid()})
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    import posix_ipc

    from sidecar.cleanup import clean_instance, instances_in
    from sidecar.runtime import InstanceRunning, UnsafeRuntimeDir, instance_paths

    config = _load(args)
    paths = instance_paths(config)
    if args.all and args.instance is not None:
        print("kvsidecar: cleanup takes --instance or --all, not both", file=sys.stderr)
        return 2
    names = instances_in(paths.runtime_dir, config.shm_dir) if args.all else [config.instance]
    live = 0
    for name in names:
        try:
            endpoints = _configured_endpoints(config) if name == config.instance else ()
            removed = clean_instance(replace(paths, instance=name), config.shm_dir, endpoints)
        except InstanceRunning as err:
            print(f"kvsidecar: {err}: nothing removed", file=sys.stderr)
            live += 1
            continue
        except UnsafeRuntimeDir as err:
            print(f"kvsidecar: {err}", file=sys.stderr)
            return 1
        except (OSError, posix_ipc.Error) as err:  # no access, a read-only file system, ...
            print(f"kvsidecar: cannot clean up instance {name!r}: {err}", file=sys.stderr)
            return 1
        _print_removed(removed)
    if not names:
        print(f"kvsidecar: no instance of uid {os.getuid()} in {paths.runtime_dir}")
    return 1 if live and not args.all else 0


def _configured_endpoints(config: Config) -> tuple[str, ...]:
    """The endpoints besides the default socket a sidecar of `config` binds."""
    from sidecar.config import ENDPOINT_KEYS

    return tuple(e for e in (getattr(config, key) for key in ENDPOINT_KEYS) if e)


def _print_removed(removed: Removed) -> None:
    for segment in removed.segments:
        print(f"removed shm segment {segment}")
    for path in removed.files:
        print(f"removed {path}")
    if removed.segments or removed.files:
        print(
            f"instance {removed.instance!r}: removed {len(removed.segments)} shm segment(s) "
            f"and {len(removed.files)} file(s), {format_size(removed.freed_bytes)} of shared "
            "memory freed"
        )
    else:
        print(f"instance {removed.instance!r}: nothing to remove")
    for reason in removed.kept:
        print(f"kept {reason}")


def _keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    directory = Path(args.dir)
    public, secret = directory / f"{args.name}.key", directory / f"{args.name}.key_secret"
    if public.exists() or secret.exists():
        print(f"kvsidecar: {public} or {secret} exists already: not replaced", file=sys.stderr)
        return 1
    if directory.exists() and not directory.is_dir():
        print(f"kvsidecar: {directory} is not a directory: nothing written", file=sys.stderr)
        return 1
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        old_umask = os.umask(0o077)  # the secret is never readable by others, even for a moment
        try:
            zmq.auth.create_certificates(directory, args.name)
        finally:
            os.umask(old_umask)
    except OSError as err:  # no permission, a file on the way, a read-only file system, ...
        print(f"kvsidecar: cannot write keys into {directory}: {err}", file=sys.stderr)
        return 1
    os.chmod(public, 0o644)
    print(f"kvsidecar: wrote {public} (public) and {secret} (secret, mode 0600)")
    return 0


def _fetch(args: argparse.Namespace) -> dict[str, Any] | None:
    from contract import protocol as p
    from engine_shim.channel import Channel, SidecarError, SidecarUnavailable
    from sidecar.runtime import endpoint_of

    endpoint = endpoint_of(_load_client(args))
    channel = Channel(endpoint, args.timeout)
    try:
        reply, _ = channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        stats: dict[str, Any] = reply.stats
        return stats
    except (SidecarUnavailable, SidecarError) as err:
        print(f"kvsidecar: no sidecar answered at {endpoint}: {err}", file=sys.stderr)
        return None
    finally:
        channel.close()


def _status(args: argparse.Namespace) -> int:
    s = _fetch(args)
    if s is None:
        return 1
    cpu, hits = s["tiers"]["cpu"], s["hits"]
    used = cpu.get("used_blocks", 0)
    cap = cpu.get("capacity_blocks")
    use = f"{used}/{cap} blocks" if cap else "no engine registered yet"
    print(
        f"kvsidecar {s['instance']!r} pid {s['pid']} on {s['endpoint']}: cpu {use} "
        f"({format_size(cpu['capacity_bytes'])}); hit ratio {hits['hit_ratio']:.3f} "
        f"(last {hits['window_requests']}: {hits['window_hit_ratio']:.3f}); "
        f"{len(s['engines'])} engine(s), {s['plans_in_flight']} plan(s) in flight"
    )
    return 0


def _stats(args: argparse.Namespace) -> int:
    s = _fetch(args)
    if s is None:
        return 1
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    for key, value in _flatten(s):
        print(f"{key:44} {value}")
    return 0


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(value, list) and value and isinstance(value[0], dict):
        out = []
        for i, v in enumerate(value):
            out += _flatten(v, f"{prefix}[{i}]")
        return out
    return [(prefix, value)]


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((w for w in words if not w.startswith("-")), None)
    args = build_parser(command).parse_args(words)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"kvsidecar: configuration error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
