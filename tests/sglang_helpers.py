"""SGLang's own objects for the backend's tests and `bench sglang`: host KV
pools built on the CPU (the recipe of SGLang's AIBrix test: a device pool
on "cpu", its buffer info, a host pool with pin_memory=False), storage
configs, page keys, and the engine processes that load what another saved.

Imports SGLang: only the side environment's tests import this module.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

MODULE = {
    "backend_name": "kvsidecar",
    "module_path": "engine_shim.sglang_storage",
    "class_name": "KVSidecarStorage",
    "interface_v1": 1,
}
"""The dynamic backend's keys, as on SGLang's command line."""

LAYERS, HEADS, HEAD_DIM = 3, 2, 8
MLA_LORA, MLA_ROPE = 16, 8


def host_pool(
    kind: str = "mha",
    layout: str = "layer_first",
    page_size: int = 4,
    *,
    tokens: int = 256,
    layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    """SGLang's host KV pool of a `kind` ("mha" / "mla") device pool of
    `tokens` tokens, built on the CPU; holds about twice as many tokens.
    Booked against a budget of its own: SGLang otherwise refuses any pool
    while the machine has less than 10 GiB available."""
    with host_memory_budget_scope(1 << 30):
        return _host_pool(kind, layout, page_size, tokens, layers, heads, head_dim, dtype)


def _host_pool(
    kind: str,
    layout: str,
    page_size: int,
    tokens: int,
    layers: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    common = {"device_capacity_tokens": tokens, "start_layer": 0, "end_layer": layers}
    if kind == "mha":
        device = MHATokenToKVPool(
            tokens, page_size, dtype, heads, head_dim, layers, "cpu", False,
            start_layer=0, end_layer=layers,
        )  # fmt: skip
        info = device.get_device_pool_infos()[0].buffer_info
        return MHATokenToKVPoolHost(
            info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu", **common
        )
    mla = MLATokenToKVPool(
        tokens, page_size, dtype, MLA_LORA, MLA_ROPE, layers, "cpu", False,
        start_layer=0, end_layer=layers,
    )  # fmt: skip
    info = mla.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        target_layer_num=layers,
        **common,
    )


def storage_config(
    endpoint: str,
    *,
    is_mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    page_first: bool = False,
    **extra: Any,
) -> HiCacheStorageConfig:
    """The config SGLang's controller builds, with kvsidecar's extra config."""
    config = {**MODULE, "endpoint": endpoint, "model_revision": "r1", "timeout": 10.0, **extra}
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=True,
        is_page_first_layout=page_first,
        model_name="tiny",
        extra_config={k: v for k, v in config.items() if v is not None},
    )


def backend(pool: Any, endpoint: str, **config: Any) -> Any:
    """kvsidecar's backend for `pool`, as SGLang makes it: the factory's
    dynamic backend, then the host pool registered."""
    is_mla = isinstance(pool, MLATokenToKVPoolHost)
    cfg = storage_config(endpoint, is_mla=is_mla, **config)
    made = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    made.register_mem_pool_host(pool)
    made.on_host_pools_registered()
    return made


def page_keys(seed: int, num_pages: int, page_size: int) -> list[str]:
    """SGLang's page hashes (SHA-256 chain, hex) of `num_pages` pages of tokens from `seed`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30_000, (num_pages * page_size,), generator=g).tolist()
    return list(get_hash_str(ids, None, page_size=page_size))


def info(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


def fill(pool: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Random bytes in the pages at `host_indices`."""
    g = torch.Generator().manual_seed(seed)
    ps = pool.page_size
    for start in host_indices[::ps].tolist():
        page = pool.get_data_page(start, flat=True)
        noise = torch.randn(page.numel(), generator=g).to(pool.dtype)
        pool.set_from_flat_data_page(start, noise)


def pages_of(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes in SGLang's own flat page order."""
    ps = pool.page_size
    return [
        pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
        for start in host_indices[::ps].tolist()
    ]


# ---- another engine process (run under multiprocessing "spawn") -------------------


def load_elsewhere(
    endpoint: str, kind: str, layout: str, page_size: int, keys: list[str], shift: int, v2: bool
) -> tuple[int, list[bool], list[bytes]]:
    """A second SGLang process: its own host pool, `shift` pages taken
    first so its pages land elsewhere; (exists, get results, page bytes)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = host_pool(kind, layout, page_size)
    if shift:
        pool.alloc(shift * page_size)
    where = pool.alloc(len(keys) * page_size)
    store = backend(pool, endpoint)
    try:
        found = store.batch_exists(keys, info([]))
        if v2:
            transfer = PoolTransfer(name=PoolName.KV, host_indices=where, keys=keys)
            got = store.batch_get_v2([transfer], info([]))[PoolName.KV]
        else:
            got = store.batch_get_v1(keys, where, info([]))
        return found, got, pages_of(pool, where)
    finally:
        store.close()


# ---- a model's KV in a host pool (the fidelity test) -----------------------------------


def _k_v_rows(pool: Any, layer: int, host_indices: torch.Tensor) -> tuple[Any, Any]:
    """Index functions (k rows, v rows) of `layer` at token `host_indices`:
    [T, heads, dim] views into the pool, for the MHA layouts."""
    k, v = pool.kv_buffer[0], pool.kv_buffer[1]
    if pool.layout == "layer_first":
        return k[layer], v[layer]
    if pool.layout == "page_first":
        return k[:, layer], v[:, layer]
    raise ValueError(f"no token rows for {pool.layout}")


def put_cache(pool: Any, cache: Any, host_indices: torch.Tensor) -> None:
    """A transformers DynamicCache's first len(host_indices) tokens into the pool."""
    n = host_indices.numel()
    for layer, cached in enumerate(cache.layers):
        k_rows, v_rows = _k_v_rows(pool, layer, host_indices)
        k_rows[host_indices] = cached.keys[0, :, :n].transpose(0, 1).to(pool.dtype)
        v_rows[host_indices] = cached.values[0, :, :n].transpose(0, 1).to(pool.dtype)


def take_cache(pool: Any, host_indices: torch.Tensor, config: Any) -> Any:
    """A DynamicCache of the pool's tokens at `host_indices`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer in range(pool.layer_num):
        k_rows, v_rows = _k_v_rows(pool, layer, host_indices)
        k = k_rows[host_indices].transpose(0, 1).unsqueeze(0).contiguous()
        v = v_rows[host_indices].transpose(0, 1).unsqueeze(0).contiguous()
        cache.update(k, v, layer)
    return cache


def continue_from_storage(
    endpoint: str, layout: str, page_size: int, keys: list[str], rest: torch.Tensor
) -> tuple[list[bool], torch.Tensor]:
    """Another SGLang process with the same tiny Llama: load the prompt's
    pages into its own host pool, and compute the logits of `rest` on them."""
    from engine_shim.hf.models import tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(0)
    pool = tiny_llama_pool(model, layout, page_size)
    pool.alloc(3 * page_size)  # its pages land elsewhere than the writer's
    where = pool.alloc(len(keys) * page_size)
    store = backend(pool, endpoint)
    try:
        got = store.batch_get_v1(keys, where, info([]))
    finally:
        store.close()
    with torch.no_grad():
        cache = take_cache(pool, where, model.config)
        logits = model(rest[None], past_key_values=cache).logits
    return got, logits


def tiny_llama_pool(model: Any, layout: str, page_size: int) -> Any:
    """A host pool of the model's KV geometry and dtype."""
    from engine_shim.hf.models import kv_geometry

    layers, heads, dim = kv_geometry(model)
    return host_pool(
        "mha", layout, page_size, layers=layers, heads=heads, head_dim=dim, dtype=model.dtype
    )
