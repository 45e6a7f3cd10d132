"""`kvsidecar clear` and `kvsidecar namespaces`: administering a running sidecar.

`clear` changes what is cached, so the sidecar asks for its admin token: a
random token it writes at start to `<runtime_dir>/<instance>.admin`, mode
0600. Whoever can read that file (the sidecar's own user, and root) may
administer; engines of other users, which the `group` setting lets connect,
may not. `namespaces` only reads what `kvsidecar stats` reports, which any
client that may connect can read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from sidecar.config import Config, format_size

TIERS = ("cpu", "ssd", "remote")


ConfigArgs = Callable[[argparse.ArgumentParser], None]
Fetch = Callable[[argparse.Namespace], "dict[str, Any] | None"]
Load = Callable[[argparse.Namespace], Config]
Timeout = Callable[[str], float]


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    config_args: ConfigArgs,
    fetch: Fetch,
    load: Load,
    timeout: Timeout,
) -> None:
    """`config_args(parser)` adds the configuration flags; `fetch(args)` gets
    the stats (None: no sidecar answered); `load(args)` the Config;
    `timeout` is the argparse type of --timeout."""
    p = sub.add_parser(
        "clear",
        help="drop cached blocks: every one, or a model's, revision's or tenant's (admin)",
        description="Drop cached blocks from a running sidecar: those of the namespaces "
        "--model, --revision and --tenant select (each left out matches any), or with --all "
        "every block; from every tier, or --tier's. The remote store's values of the blocks "
        "this sidecar knows go too. Blocks a transfer in flight is using stay (counted as "
        "kept). Needs the sidecar's admin token, which it writes to "
        "<runtime_dir>/<instance>.admin (mode 0600): run it as the sidecar's user.",
    )
    config_args(p)
    p.add_argument("--tier", choices=TIERS, help="only this tier")
    p.add_argument("--model", default="", help="the model name engines registered")
    p.add_argument("--revision", default="", help="the model revision engines registered")
    p.add_argument("--tenant", default="", help="the tenant engines registered")
    p.add_argument(
        "--all",
        action="store_true",
        help="every namespace (with no selector: not with --model, --revision, --tenant)",
    )
    p.add_argument("--timeout", type=timeout, default=10.0, help="seconds to wait (default 10)")
    p.set_defaults(func=lambda args: _clear(args, load))
    p = sub.add_parser(
        "namespaces",
        help="what each namespace (model, revision, tenant) holds in each tier",
        description="Per namespace (model, revision, tenant) of a running sidecar: blocks and "
        "bytes per tier, configured quotas and TTL, lookups and hits.",
    )
    config_args(p)
    p.add_argument("--timeout", type=timeout, default=2.0, help="seconds to wait (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=lambda args: _namespaces(args, fetch))


def _clear(args: argparse.Namespace, load: Load) -> int:
    from contract import protocol as p
    from engine_shim.channel import Channel, SidecarError, SidecarUnavailable
    from sidecar.runtime import endpoint_of, instance_paths, read_admin_token

    if not (args.all or args.model or args.revision or args.tenant):
        print(
            "kvsidecar clear: say what to clear: --model, --revision, --tenant, or --all",
            file=sys.stderr,
        )
        return 2
    if args.all and (args.model or args.revision or args.tenant):
        print(
            "kvsidecar clear: --all is every namespace: give it no --model, --revision or --tenant",
            file=sys.stderr,
        )
        return 2
    config = load(args)
    path = instance_paths(config).admin_token_path
    try:
        token = read_admin_token(path)
    except OSError as err:
        print(f"kvsidecar clear: cannot read the admin token {path}: {err}", file=sys.stderr)
        return 1
    endpoint = endpoint_of(config)
    channel = Channel(endpoint, args.timeout)
    request = p.Clear(
        v=p.PROTOCOL_VERSION,
        id=0,
        token=token,
        tier=args.tier or "",
        model=args.model,
        revision=args.revision,
        tenant=args.tenant,
    )
    try:
        reply, _ = channel.call(request)
    except (SidecarUnavailable, SidecarError) as err:
        print(f"kvsidecar clear: {endpoint}: {err}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    removed, kept = reply.removed, reply.kept
    what = "every namespace" if args.all else f"{reply.namespaces} namespace(s)"
    tiers = ", ".join(f"{t} {removed[t]}" for t in removed) or "nothing"
    print(f"kvsidecar clear: {what}: blocks dropped: {tiers}")
    if any(kept.values()):
        print(f"kvsidecar clear: kept (in use by transfers in flight): {kept}")
    return 0


def _namespaces(args: argparse.Namespace, fetch: Fetch) -> int:
    stats = fetch(args)
    if stats is None:
        return 1
    rows = stats.get("namespaces", [])
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no namespace has registered or cached anything")
        return 0
    print(f"{'model@revision':40} {'tenant':10} {'tier':6} {'blocks':>9} {'bytes':>10} limits")
    for row in rows:
        name = f"{row['model']}@{row['revision']}" if row["revision"] else row["model"]
        tiers = row["tiers"] or {"-": {"blocks": 0, "bytes": 0}}
        for i, (tier, use) in enumerate(sorted(tiers.items())):
            quota = row["quota_bytes"].get(tier)
            limits = [f"quota {format_size(quota)}"] if quota is not None else []
            if i == 0 and row["ttl_seconds"] is not None:
                limits.append(f"ttl {row['ttl_seconds']:g}s")
            first = (name, row["tenant"] or "-") if i == 0 else ("", "")
            print(
                f"{first[0]:40} {first[1]:10} {tier:6} {use['blocks']:>9} "
                f"{format_size(use['bytes']):>10} {' '.join(limits)}"
            )
        print(f"{'':40} {'':10} lookups {row['lookup_blocks']} blocks, {row['hit_blocks']} hit")
    return 0
