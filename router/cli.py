"""`kvsidecar router serve`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import zmq

from contract.endpoint import CurveClientKeys, curve_client_keys, load_curve_client_keys
from router.index import default_index
from router.subscriber import Source


def add_choice_args(p: argparse.ArgumentParser) -> None:
    """The index and worker-choice options `kvsidecar router` and the proxy share."""
    p.add_argument(
        "--index",
        choices=("native", "radix", "flat"),
        default=default_index(),
        help="the index: native (C, the default where built), radix or flat (Python)",
    )
    p.add_argument("--overlap-weight", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = always the lowest cost")
    p.add_argument("--seed", type=int, default=0, help="seed of the temperature draws")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = sub.add_parser("router", help="the cluster KV-aware router")
    router_sub = router.add_subparsers(dest="router_command", metavar="COMMAND")
    router_sub.required = True
    p = router_sub.add_parser(
        "serve",
        help="subscribe to sidecars' and engines' KV events, answer which worker to use",
        description="Answers route/match/stats requests (msgpack over ZMQ REQ/REP); "
        "see docs/router.md.",
    )
    p.add_argument("--bind", default="tcp://127.0.0.1:5600", help="REP endpoint to bind")
    p.add_argument(
        "--sidecar",
        action="append",
        default=[],
        metavar="PUB[,RESYNC]",
        help="a sidecar's events_endpoint and, after a comma, its events_resync_endpoint "
        "(repeatable)",
    )
    p.add_argument(
        "--vllm",
        action="append",
        default=[],
        metavar="PUB=WORKER_ID",
        help="a vLLM engine's KV events endpoint and the worker id to give it (repeatable)",
    )
    add_choice_args(p)
    p.add_argument("--window", type=int, default=1000, help="requests in the hit-ratio window")
    p.add_argument(
        "--namespace",
        type=Path,
        metavar="FILE",
        help="JSON of the sidecars' Namespace fields (to route by token ids)",
    )
    p.add_argument("--key-hash", default="blake2b", choices=("blake2b", "xxh3_128"))
    p.add_argument(
        "--secret-file",
        type=Path,
        metavar="FILE",
        help="the engines' deployment secret (the bytes of FILE, as given to "
        "KVClient.register(secret=...)): needed to route by token ids when they use one",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="forget a sidecar's blocks after this long without a message from it "
        "(sidecars send a heartbeat every second; 0 = never)",
    )
    p.add_argument(
        "--curve-server-key",
        type=Path,
        metavar="FILE",
        help="the sidecars' public key file, for tcp:// events that require CURVE "
        "(default: $KVSIDECAR_CURVE_SERVER_KEY)",
    )
    p.add_argument(
        "--curve-client-key",
        type=Path,
        metavar="FILE",
        help="this router's .key_secret file, listed by the sidecars "
        "(default: $KVSIDECAR_CURVE_CLIENT_KEY)",
    )
    p.set_defaults(func=_serve)
    from router.proxy_cli import add_parser as add_proxy_parser

    add_proxy_parser(router_sub)


def parse_sources(sidecars: list[str], vllms: list[str]) -> list[Source]:
    sources = []
    for text in sidecars:
        pub, _, resync = text.partition(",")
        sources.append(Source(pub, resync or None))
    for text in vllms:
        pub, sep, wid = text.rpartition("=")
        if not sep or not wid.isascii() or not wid.isdigit() or int(wid) >= 2**63:
            raise ValueError(f"--vllm wants PUB=WORKER_ID (an int64 >= 0), got {text!r}")
        sources.append(Source(pub, None, int(wid)))
    seen: set[str] = set()
    for s in sources:
        for endpoint in (s.endpoint, s.resync_endpoint):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"not a ZMQ endpoint: {endpoint!r}")
        if s.endpoint in seen:
            raise ValueError(f"{s.endpoint} is given twice: every event would be applied twice")
        seen.add(s.endpoint)
    return sources


def _serve(args: argparse.Namespace) -> int:
    from contract.blocks import KeyHasher, Namespace
    from router.router import Router
    from router.serve import RouterServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        sources = parse_sources(args.sidecar, args.vllm)
        hasher = None
        if args.secret_file is not None and args.namespace is None:
            raise ValueError("--secret-file is for routing by token ids: give --namespace too")
        if not args.worker_timeout >= 0:
            raise ValueError(f"--worker-timeout must be >= 0, got {args.worker_timeout}")
        if args.namespace is not None:
            ns = Namespace(**json.loads(args.namespace.read_text()))
            secret = b"" if args.secret_file is None else args.secret_file.read_bytes()
            hasher = KeyHasher(ns, secret=secret, algorithm=args.key_hash)
        curve = _curve_keys(args)
        router = Router(
            args.index,
            overlap_weight=args.overlap_weight,
            temperature=args.temperature,
            seed=args.seed,
            window=args.window,
            hasher=hasher,
        )
    except (ValueError, TypeError, OSError) as exc:
        print(f"kvsidecar router: {exc}", file=sys.stderr)
        return 2
    try:
        server = RouterServer(router, args.bind, sources, args.worker_timeout, curve)
    except zmq.ZMQError as exc:
        print(f"kvsidecar router: cannot bind or connect: {exc}", file=sys.stderr)
        return 2
    print(f"router serving on {server.endpoint} ({len(sources)} source(s))", flush=True)
    server.serve_forever()
    return 0


def _curve_keys(args: argparse.Namespace) -> CurveClientKeys | None:
    """The CURVE keys the flags name, else those of the environment (None
    when neither names any); ValueError for half a pair or a bad file."""
    if args.curve_server_key is None and args.curve_client_key is None:
        return curve_client_keys()
    if args.curve_server_key is None or args.curve_client_key is None:
        raise ValueError("--curve-server-key and --curve-client-key go together")
    return load_curve_client_keys(args.curve_server_key, args.curve_client_key)
