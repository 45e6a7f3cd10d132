"""`kvsidecar bench ...`: one subcommand per benchmark module."""

from __future__ import annotations

import argparse
import importlib

# Each module defines `add_parser(subparsers)` that registers its subcommand
# and sets `func` on the parsed namespace.
BENCH_MODULES = (
    "bench.index",
    "bench.replay_live",  # cachesim.replay's subcommand, with --live
    "bench.shm",
    "bench.control",
    "bench.gpu",
    "bench.ssd",
    "bench.ttft",
    "bench.remote",
    "bench.router",
    "bench.sglang",
    "bench.connector",
)


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench",
        help="run a benchmark (prints a table, writes JSON with --json)",
        description="Benchmarks report ratios to a floor measured in the same run.",
    )
    bench_sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench_sub.required = True
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(bench_sub)
