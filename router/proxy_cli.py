"""`kvsidecar router proxy`: the command line of the HTTP front."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from contract.blocks import KeyHasher, Namespace
from router.cli import add_choice_args
from router.upstreams import WorkerSpec, parse_workers

if TYPE_CHECKING:
    from router.proxy import Proxy

DESCRIPTION = """\
An OpenAI-compatible HTTP front (/v1/completions, /v1/chat/completions with
streaming, /v1/models, /health, /metrics) in front of vLLM or SGLang servers.
Each request is tokenized with the model's tokenizer and sent to the engine
that holds most of its prompt's KV blocks (from the engines' KV events), net
of the requests in flight on each; an engine that cannot be reached is skipped.
An engine silent for --read-timeout is not skipped (it may be generating):
the client gets a 504, or its connection is closed if the reply had begun.

  --worker URL[,vllm=EVENTS][,sidecar=PUB][,resync=RESYNC][,id=N]

vllm=: the engine's own ZMQ KV events (vLLM's or SGLang's --kv-events-config);
sidecar=/resync=: the events of the kvsidecar it saves through (whose
events_worker_id must be id, by default the worker's position, 0, 1, ...).
See docs/router.md.
"""


def add_parser(router_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = router_sub.add_parser(
        "proxy",
        help="an OpenAI-compatible HTTP front routing to the engine holding the prompt's KV",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    p.add_argument("--worker", action="append", default=[], metavar="SPEC", help="(repeatable)")
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the model's tokenizer, a local directory (without: route by load alone)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="the vLLM engines' block size (tokens)"
    )
    p.add_argument(
        "--namespace",
        type=Path,
        metavar="FILE",
        help="JSON of the sidecars' Namespace fields (for sidecar= workers)",
    )
    p.add_argument("--key-hash", default="blake2b", choices=("blake2b", "xxh3_128"))
    p.add_argument("--secret-file", type=Path, metavar="FILE", help="the engines' secret")
    add_choice_args(p)
    p.add_argument(
        "--down-seconds",
        type=float,
        default=5.0,
        help="how long an engine that refused a connection is not tried",
    )
    p.add_argument("--connect-timeout", type=float, default=2.0, metavar="SECONDS")
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long an engine may send nothing, before its reply's headers (a non-streamed "
        "reply's come after the whole generation) and between chunks; then 504, or the "
        "client's connection is closed mid-reply (default 600; 0 = no limit)",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="forget a sidecar's blocks after this long without a message from it (0 = never)",
    )
    p.set_defaults(func=_proxy)


def _proxy(args: argparse.Namespace) -> int:
    from router.cli import _curve_keys
    from router.prompts import PromptTokenizer
    from router.proxy import Proxy
    from router.proxy_routing import ProxyRouting
    from router.router import Router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.curve_server_key = args.curve_client_key = None  # CURVE from the environment
    try:
        specs = parse_workers(args.worker)
        if not 0 <= args.port < 65536 or args.block_size < 1:
            raise ValueError("--port must be 0-65535 and --block-size >= 1")
        if not (args.down_seconds >= 0 and args.connect_timeout > 0):
            raise ValueError("--down-seconds must be >= 0 and --connect-timeout > 0")
        if not (math.isfinite(args.read_timeout) and args.read_timeout >= 0):
            raise ValueError("--read-timeout must be a number of seconds >= 0 (0: no limit)")
        sidecar_keys = _sidecar_hasher(args)
        vllm_keys = _vllm_hasher(args, specs)
        prompts = PromptTokenizer(args.tokenizer) if args.tokenizer else None
        router = Router(
            args.index,
            overlap_weight=args.overlap_weight,
            temperature=args.temperature,
            seed=args.seed,
        )
        routing = ProxyRouting(
            specs,
            router,
            sidecar_keys=sidecar_keys,
            vllm_keys=vllm_keys,
            down_seconds=args.down_seconds,
            worker_timeout=args.worker_timeout,
            curve=_curve_keys(args),
        )
    except (ValueError, TypeError, OSError) as exc:
        print(f"kvsidecar router proxy: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:
        print(f"kvsidecar router proxy: cannot connect to events: {exc}", file=sys.stderr)
        return 2
    proxy = Proxy(
        routing,
        prompts,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout or None,
    )
    routing.start()
    try:
        return asyncio.run(_serve(proxy, args.host, args.port, len(specs)))
    finally:
        routing.close()


async def _serve(proxy: Proxy, host: str, port: int, n_workers: int) -> int:
    from aiohttp import web

    runner = web.AppRunner(proxy.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            print(f"kvsidecar router proxy: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
            return 2
        bound = runner.addresses[0]
        print(
            f"router proxy listening on http://{bound[0]}:{bound[1]} ({n_workers} worker(s))",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    finally:
        await runner.cleanup()


def _sidecar_hasher(args: argparse.Namespace) -> KeyHasher | None:
    if args.namespace is None:
        if args.secret_file is not None:
            raise ValueError("--secret-file goes with --namespace")
        return None
    ns = Namespace(**json.loads(args.namespace.read_text()))
    secret = b"" if args.secret_file is None else args.secret_file.read_bytes()
    return KeyHasher(ns, secret=secret, algorithm=args.key_hash)


def _vllm_hasher(args: argparse.Namespace, specs: list[WorkerSpec]) -> KeyHasher | None:
    """The proxy's own hasher of vLLM blocks' tokens (None without vllm= workers)."""
    if not any(s.kind == "vllm" for s in specs):
        return None
    if args.tokenizer is None:
        raise ValueError("vllm= workers are matched by tokens: give --tokenizer")
    ns = Namespace(
        model_name=Path(args.tokenizer).name or "model",
        model_revision="vllm-events",
        layout="vllm",
        dtype="any",
        tp_size=1,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        tokens_per_block=args.block_size,
    )
    return KeyHasher(ns)
