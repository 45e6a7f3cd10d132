"""`kvsidecar bench replay` (cachesim/replay.py) with `--live`: the same
requests through a running sidecar.

The offline replay drives the CPU tier's control plane in-process, so it
measures the policies and nothing else. A live pass starts a private
`kvsidecar serve` with the policy under test and drives it with a
`KVClient` as vLLM's and SGLang's adapters do (precomputed keys, the hot
path on): look the request's keys up, load the hit prefix, save the whole
request and wait for the save to land. So every part a running sidecar
adds is in the figure: the hot index, Touch batches, grants set aside from
the tier, `auto`'s shadows fed from the engines' chains between requests.

The trace's block ids are the keys (prefix-consistent traces only, as
offline), each block a 4 KiB fp16 KV slot (one layer, one head), so the
bytes copied stay small; the hit ratio is the lookups' hit blocks over the
blocks looked up, as offline.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cachesim import replay
from cachesim.replay import LivePass
from cachesim.trace import Trace
from contract.ids import BlockKeys
from engine_shim import KVClient
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar

SLOT_BYTES = 4096
"""One block's KV here: the smallest slot (a page)."""
MIN_BLOCKS = (1 << 20) // SLOT_BYTES
"""The smallest CPU tier a sidecar takes (1 MiB), in such blocks."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = replay.add_parser(subparsers)
    p.add_argument(
        "--live",
        action="store_true",
        help="also replay every policy and capacity through a running sidecar "
        "(slower: every block is copied; see above)",
    )
    p.set_defaults(func=lambda args: replay.run(args, live_pass))


def live_pass(
    trace: Trace,
    keys: BlockKeys,
    policy: str,
    capacity: int,
    *,
    evict_start_threshold: float,
    evict_ratio: float,
    on_request: Callable[[], None] | None = None,
) -> LivePass:
    """One pass of `trace` (its keys back to back in `keys`) through a
    private sidecar of `capacity` CPU blocks under `policy`. ValueError for
    a capacity below MIN_BLOCKS."""
    if capacity < MIN_BLOCKS:
        raise ValueError(
            f"--live needs capacities of at least {MIN_BLOCKS} blocks "
            f"(a sidecar's CPU tier is at least 1 MiB), got {capacity}"
        )
    tpb = trace.tokens_per_block
    offsets = trace.offsets.tolist()
    longest = int(np.diff(trace.offsets).max(initial=0))
    # [blocks, K/V, tokens, heads, dim] in fp16: 2 * tpb * dim * 2 bytes = one page.
    kv = [torch.zeros((max(longest, 1), 2, tpb, 1, SLOT_BYTES // (4 * tpb)), dtype=torch.float16)]
    settings = {
        **BENCH_SIDECAR_SETTINGS,
        "eviction_policy": policy,
        "evict_start_threshold": evict_start_threshold,
        "evict_ratio": evict_ratio,
        "prefault": False,
    }
    with tempfile.TemporaryDirectory(prefix="kvs-live-") as work:
        sidecar = LocalSidecar(
            Path(work), cpu_capacity=str(capacity * SLOT_BYTES), settings=settings, tag="live"
        ).start()
        try:
            with KVClient.connect(sidecar.endpoint, timeout=60.0) as client:
                client.register(
                    kv,
                    model_name="replay",
                    model_revision="live",
                    tokens_per_block=tpb,
                    num_kv_heads=1,
                    head_dim=kv[0].shape[-1],
                )
                blocks = np.arange(longest, dtype=np.int64)
                hits = 0
                start = time.perf_counter()
                for r in range(len(offsets) - 1):
                    request = BlockKeys(keys[offsets[r] : offsets[r + 1]])
                    n = client.lookup_keys(request) // tpb
                    if n:
                        n = client.load_keys(BlockKeys(request[:n]), blocks[:n]).wait() // tpb
                    hits += n
                    client.save_keys(request, blocks[: request.size]).wait()
                    if on_request is not None:
                        on_request()
                seconds = time.perf_counter() - start
                cpu = client.stats()["tiers"]["cpu"]
                # The sidecar works off the last chains between requests: wait for them.
                deadline = time.monotonic() + 120.0
                while cpu["policy"].get("pending", 0) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    cpu = client.stats()["tiers"]["cpu"]
        finally:
            shutdown = sidecar.close()
        if shutdown.exit_code != 0 or shutdown.leftovers:
            raise RuntimeError(f"the live sidecar did not stop cleanly: {shutdown}")
    return LivePass(hits, seconds, int(cpu["capacity_blocks"]), cpu["policy"])
