"""AIBrix's in-process L1 KV cache (`aibrix-kvcache`, its side environment)
behind `bench control`'s per-call rows; see bench/peers/calls.py for the
protocol. Run as `python -m bench.peers.aibrix_worker` with the project's
root on sys.path.

Driven as AIBrix's own vLLM connector (aibrix_offloading_connector_type1)
drives it, call for call: a save walks `cache_chunk_keys` (chunks of
AIBRIX_KV_CACHE_OL_CHUNK_SIZE tokens, 512 by default) and per chunk asks
`exists`, `allocate_for`, copies the engine blocks into the handle's
tensors, then `put`; a load walks the chunks with `acquire`, copies the
handle's tensors into the engine blocks and `release`s it, stopping at the
first partial chunk; a lookup is one `exists` of the prompt. L1 only (no
L2 backend), in block layout LCND ([layers, K/V, tokens, heads, dim]), so
each layer of a block is as contiguous as in the engine's tensors.

AIBrix's CUDA copy kernels (reshape_and_cache_multi_layer and its offload
twin) do not load on CPU, so the copies are kvsidecar's own C block copy
(bench/peers/block_copy.py) over the same [block, layer] ranges: the rows
differ from kvsidecar's only in what each does around the copy. Pinned
memory is off (AIBrix's TESTING_DISABLE_PIN_MEMORY; pinning needs CUDA).
Prompts reach AIBrix as a TokenListView built once per prompt, untimed, as
vLLM hands the connector a request's token list it already holds.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import version
from typing import Any

import numpy as np
import torch

from bench.peers.block_copy import copy_ranges, layer_addresses
from bench.peers.calls import block_bytes, worker_main


class AibrixSystem:
    def __init__(self) -> None:
        self._cache: Any = None
        self._views: dict[tuple[int, int], Any] = {}
        self._tpb = 1
        self._layer_bytes = 0
        self._layer_ptrs = np.zeros(0, dtype=np.uint64)
        self._per_layer = np.zeros(0, dtype=np.uint64)
        self._kv: list[torch.Tensor] = []

    def open(self, geometry: dict[str, Any], kv_blocks: int, cache_blocks: int) -> None:
        g = geometry
        self._tpb = g["tokens_per_block"]
        self._layer_bytes = block_bytes(g) // g["num_layers"]
        # Read when aibrix_kvcache.envs is first used, i.e. by the manager below.
        capacity_gb = cache_blocks * block_bytes(g) / 2**30
        os.environ["AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB"] = f"{capacity_gb:.4f}"
        os.environ["AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND"] = ""
        os.environ["AIBRIX_KV_CACHE_OL_TIME_MEASUREMENT_ENABLED"] = "0"
        os.environ["AIBRIX_KV_CACHE_OL_BREAKDOWN_MEASUREMENT_ENABLED"] = "0"
        import aibrix_kvcache
        from aibrix_kvcache import cache_manager

        cache_manager.TESTING_DISABLE_PIN_MEMORY = True
        a = aibrix_kvcache
        spec = a.KVCacheBlockSpec(
            block_ntokens=self._tpb,
            block_dtype=torch.float16,
            block_layout=a.KVCacheBlockLayout.LCND,
            tensor_spec=a.KVCacheTensorSpec(
                heads=list(range(g["num_kv_heads"])),
                layers=list(range(g["num_layers"])),
                head_size=g["head_dim"],
            ),
        )
        max_len = cache_blocks * self._tpb
        config = a.KVCacheConfig(block_spec=spec, model_spec=a.ModelSpec(max_len, max_len))
        self._cache = a.BaseKVCacheManager(config=config)
        shape = (kv_blocks, 2, self._tpb, g["num_kv_heads"], g["head_dim"])
        self._kv = [torch.ones(shape, dtype=torch.float16) for _ in range(g["num_layers"])]
        self._layer_ptrs = np.array([t.data_ptr() for t in self._kv], dtype=np.uint64)
        self._per_layer = np.arange(g["num_layers"], dtype=np.uint64) * np.uint64(self._layer_bytes)

    def _view(self, tokens: np.ndarray) -> Any:
        key = (int(tokens[0]), len(tokens))
        view = self._views.get(key)
        if view is None:
            from aibrix_kvcache import TokenListView

            view = self._views[key] = TokenListView(tokens.astype(np.int32))
        return view

    def _copy(self, blocks: np.ndarray, tensors: Any, save: bool) -> None:
        engine = layer_addresses(self._layer_ptrs, blocks, self._layer_bytes)
        starts = np.fromiter((t.data_ptr() for t in tensors), dtype=np.uint64, count=len(tensors))
        cache = starts[:, None] + self._per_layer[None, :]
        src, dst = (engine, cache) if save else (cache, engine)
        copy_ranges(src, dst, self._layer_bytes, save=save)

    def save(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        saved = 0
        for prefix, chunk, _, _ in self._cache.cache_chunk_keys(None, self._view(tokens)):
            first = len(prefix) // self._tpb
            exists = self._cache.exists(prefix, chunk)
            if exists.is_ok() and len(chunk) - exists.value < self._tpb:
                saved += len(chunk)
                continue
            status = self._cache.allocate_for(prefix, chunk)
            if not status.is_ok():
                raise RuntimeError(f"AIBrix allocate_for: {status}")
            handle = status.value
            tensors = handle.to_tensors()
            self._copy(block_ids[first : first + len(tensors)], tensors, save=True)
            status = self._cache.put(prefix, chunk[: len(tensors) * self._tpb], handle)
            if not status.is_ok():
                raise RuntimeError(f"AIBrix put: {status}")
            saved += status.value
        return saved

    def forget(self, tokens: np.ndarray) -> None:
        status = self._cache.delete(None, self._view(tokens))
        if not status.is_ok():
            raise RuntimeError(f"AIBrix delete: {status}")

    def load(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        loaded = 0
        for prefix, chunk, _, _ in self._cache.cache_chunk_keys(None, self._view(tokens)):
            status = self._cache.acquire(prefix, chunk)
            if not status.is_ok():
                break
            num, handle = status.value
            first = len(prefix) // self._tpb
            tensors = handle.to_tensors()
            self._copy(block_ids[first : first + len(tensors)], tensors, save=False)
            handle.release()
            loaded += num
            if num < len(chunk):
                break
        return loaded

    def lookup(self, tokens: np.ndarray) -> int:
        status = self._cache.exists(None, self._view(tokens))
        return int(status.value) if status.is_ok() else 0

    def prepare_load(self, tokens: np.ndarray) -> None:
        pass

    def tidy(self) -> None:
        pass

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        self._views.clear()
        self._kv = []


if __name__ == "__main__":
    sys.exit(
        worker_main(
            lambda _: AibrixSystem(), "aibrix-kvcache " + version("aibrix-kvcache"), "aibrix"
        )
    )
