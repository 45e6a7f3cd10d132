"""The measuring half of `bench sglang` (bench/sglang.py says what it
measures): SGLang's objects and a private sidecar. Imports SGLang, so only
the SGLang side environment imports this module."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from bench.sglang import BATCH, LLAMA3_8B_KV, median_rate, timed
from bench.shm import _raw_floors, _segment_bytes
from engine_shim.local_sidecar import BENCH_SIDECAR_SETTINGS, LocalSidecar
from shm.pool import ShmPool

SIDECAR_SLACK = 64 << 20
"""CPU tier bytes beyond the pages (slot rounding, a second geometry's extents)."""


@dataclass(frozen=True)
class Setup:
    page_size: int
    layout: str
    layers: int
    heads: int
    max_pages: int

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.page_size * self.heads * LLAMA3_8B_KV["head_dim"] * 2


def host_pool(setup: Setup) -> MHATokenToKVPoolHost:
    """SGLang's host pool of max_pages pages, touched (no page faults timed);
    its device pool (on the CPU: no CUDA here) is two pages."""
    ps, layers = setup.page_size, setup.layers
    device = MHATokenToKVPool(
        2 * ps, ps, torch.bfloat16, setup.heads, LLAMA3_8B_KV["head_dim"], layers, "cpu",
        False, start_layer=0, end_layer=layers,
    )  # fmt: skip
    # SGLang keeps 10 GiB of the machine's available memory from any pool;
    # the benchmark books its pool against what it needs instead.
    with host_memory_budget_scope((setup.max_pages + 1) * setup.page_bytes):
        pool = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, ps, setup.layout,
            pin_memory=False, device="cpu", device_capacity_tokens=2 * ps, start_layer=0,
            end_layer=layers, host_token_capacity=(setup.max_pages + 1) * ps,
        )  # fmt: skip
    pool.kv_buffer.view(torch.uint8).fill_(1)
    return pool


def backend(pool: MHATokenToKVPoolHost, endpoint: str) -> Any:
    extra = {
        "backend_name": "kvsidecar",
        "module_path": "engine_shim.sglang_storage",
        "class_name": "KVSidecarStorage",
        "interface_v1": 1,
        "model_revision": "bench",
        "endpoint": endpoint,
        "timeout": 30.0,
    }
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=pool.layout != "layer_first", model_name="llama-3-8b-geometry",
        extra_config=extra,
    )  # fmt: skip
    store = StorageBackendFactory.create_backend("dynamic", config, pool)
    store.register_mem_pool_host(pool)
    store.on_host_pools_registered()
    return store


def measure(setup: Setup, sizes: list[int], repeats: int, work: Path) -> dict[int, dict]:
    pool = host_pool(setup)
    capacity = setup.max_pages * setup.page_bytes + SIDECAR_SLACK
    sidecar = LocalSidecar(
        work, cpu_capacity=str(capacity), settings=BENCH_SIDECAR_SETTINGS, tag="sglang"
    ).start()
    try:
        store = backend(pool, sidecar.endpoint)
        try:
            return {n: _size(setup, pool, store, n, repeats) for n in sizes}
        finally:
            store.close()
    finally:
        shutdown = sidecar.close()
        if shutdown.leftovers:
            raise RuntimeError(f"the sidecar left shm segments: {shutdown.leftovers}")


def _size(setup: Setup, pool: Any, store: Any, n: int, repeats: int) -> dict[str, Any]:
    ps = setup.page_size
    ids = torch.randint(0, 128_000, (n * ps,), generator=torch.Generator().manual_seed(n))
    keys = list(get_hash_str(ids.tolist(), None, page_size=ps))
    where = pool.alloc(n * ps)
    sample = [0, n // 2, n - 1]
    g = torch.Generator().manual_seed(n + 1)
    for i in sample:  # these pages must come back byte for byte
        page = pool.get_data_page(int(where[i * ps]), flat=True)
        pool.set_from_flat_data_page(int(where[i * ps]), torch.randn(page.numel(), generator=g))
    nbytes = n * setup.page_bytes
    host = pool.kv_buffer.view(-1).view(torch.uint8)[:nbytes].numpy()
    prefix = f"kvsbench.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    with ShmPool.create(prefix, nbytes, segment_bytes=_segment_bytes(nbytes)) as floor_pool:
        shm = floor_pool.segment_view(0)[:nbytes]  # what the sidecar's slots are: POSIX shm
        floors = {
            "floor_numpy_save": partial(np.copyto, shm, host),
            "floor_numpy_load": partial(np.copyto, host, shm),
            **_raw_floors(host, shm, None),  # host -> shm is the save direction
        }
        times = _rounds(store, pool, keys, where, sample, floors, repeats)
        del shm, floors
    pool.free(where)
    case: dict[str, Any] = {"pages": n, "bytes": nbytes}
    for kind in ("set", "get"):
        case[f"{kind}_pages_per_s"] = median_rate(times[kind], n)
        case[f"{kind}_gbps"] = median_rate(times[kind], nbytes / 1e9)
    for d in ("save", "load"):
        for k in ("numpy", "raw"):
            case[f"floor_{k}_{d}_gbps"] = median_rate(times[f"floor_{k}_{d}"], nbytes / 1e9)
        case[f"floor_{d}_gbps"] = max(case[f"floor_{k}_{d}_gbps"] for k in ("numpy", "raw"))
    case["set_vs_floor"] = case["set_gbps"] / case["floor_save_gbps"]
    case["get_vs_floor"] = case["get_gbps"] / case["floor_load_gbps"]
    case["seconds"] = times
    return case


def _rounds(
    store: Any,
    pool: Any,
    keys: list[str],
    where: torch.Tensor,
    sample: list[int],
    floors: dict[str, Any],
    repeats: int,
) -> dict[str, list[float]]:
    """Seconds of each round's set, get and floors, interleaved (round 0 warms up)."""
    ps = pool.page_size
    expected = [_page(pool, where, i) for i in sample]
    garbage = torch.zeros(pool.get_data_page(0, flat=True).numel(), dtype=pool.dtype)
    times: dict[str, list[float]] = {k: [] for k in ("set", "get", *floors)}
    for round_ in range(repeats + 1):
        if not store.clear() or store.batch_exists(keys, HiCacheStorageExtraInfo([])):
            raise RuntimeError("the backend could not clear the sidecar: a set would copy less")
        took = {"set": timed(partial(_calls, store.batch_set_v2, keys, where, ps))}
        for i in sample:  # garbage where the get must put the pages back
            pool.set_from_flat_data_page(int(where[i * ps]), garbage)
        took["get"] = timed(partial(_calls, store.batch_get_v2, keys, where, ps))
        if [_page(pool, where, i) for i in sample] != expected:
            raise RuntimeError("pages came back with other bytes: the benchmark measures nothing")
        for name, fn in floors.items():
            took[name] = timed(fn)
        if round_:
            for name, seconds in took.items():
                times[name].append(seconds)
    return times


def _calls(call: Any, keys: list[str], where: torch.Tensor, ps: int) -> None:
    """Every page through `call` in SGLang's batches, each with its prefix keys."""
    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        span = where[start * ps : (start + len(batch)) * ps]
        transfer = PoolTransfer(name=PoolName.KV, host_indices=span, keys=batch)
        done = call([transfer], HiCacheStorageExtraInfo(prefix_keys=keys[:start]))
        if done[PoolName.KV] != [True] * len(batch):
            raise RuntimeError(f"pages {start}.. failed: {done[PoolName.KV].count(False)} of them")


def _page(pool: Any, where: torch.Tensor, i: int) -> bytes:
    start = int(where[i * pool.page_size])
    page = pool.get_data_page(start, flat=True).contiguous()
    return bytes(page.view(torch.uint8).numpy().tobytes())
