"""`PagedKV`: the engine-side paged KV pool the HF adapter registers with the
sidecar, and the copies between it and a transformers `DynamicCache`.

One tensor per layer, block-major, on the model's device (a CUDA pool is
copied to and from the sidecar's shm by cuda_ext's GPU copier; a CPU pool by
plain memcpy):

    layers[i][block, 0] = keys,   [tokens_per_block, num_kv_heads, head_dim]
    layers[i][block, 1] = values, [tokens_per_block, num_kv_heads, head_dim]

The pool holds one prompt at a time: pool block j holds the prompt's j-th
block of tokens, so a block id is simply the block's index in the prompt.
A `DynamicCache` layer holds keys and values as [batch=1, num_kv_heads,
tokens, head_dim]; keys are stored after RoPE, exactly as the model caches
them, so loaded keys need no rotation.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer


class PagedKV:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        tokens_per_block: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_blocks, tokens_per_block, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                "PagedKV needs at least one layer, block, token per block, KV head and "
                f"head dim; got {num_layers}, {num_blocks}, {tokens_per_block}, "
                f"{num_kv_heads}, {head_dim}"
            )
        shape = (num_blocks, 2, tokens_per_block, num_kv_heads, head_dim)
        self.device = torch.device(device)
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (what one sidecar slot holds)."""
        first = self.layers[0]
        return len(self.layers) * first[0].numel() * first.element_size()

    def to_cache(self, num_blocks: int, config: PretrainedConfig) -> DynamicCache:
        """A DynamicCache holding blocks [0, num_blocks) as its first
        num_blocks * tokens_per_block tokens (empty for 0), on the pool's device.

        For a model whose every layer is full attention (all that CachedLM
        takes; `config` must say so): each layer is a `DynamicLayer` given
        its keys and values as they come out of the pool's one reordering
        copy. `DynamicCache.update` would copy them again (a `cat` onto an
        empty tensor), and building the cache from `config` reads it through
        transformers' attribute hooks: of a 32-block CPU load's 0.44 ms in
        this method, ~0.3 ms went there."""
        if not 0 <= num_blocks <= self.num_blocks:
            raise ValueError(f"num_blocks must be in [0, {self.num_blocks}], got {num_blocks}")
        if num_blocks == 0:
            return DynamicCache(config=config)
        cache = DynamicCache()
        tokens = num_blocks * self.tokens_per_block
        for layer in self.layers:
            # [n, 2, t, h, d] -> [2, h, n*t, d]: block order is token order.
            kv = layer[:num_blocks].permute(1, 3, 0, 2, 4)
            kv = kv.reshape(2, self.num_kv_heads, tokens, self.head_dim)
            keys, values = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
            filled = DynamicLayer()
            filled.lazy_initialization(keys, values)
            filled.keys, filled.values = keys, values
            cache.layers.append(filled)
        return cache

    def from_cache(self, cache: DynamicCache, first: int, end: int) -> None:
        """Copy blocks [first, end) of the prompt from `cache` (on the pool's
        device, holding at least end * tokens_per_block tokens) into the pool."""
        if end <= first:
            return
        if first < 0 or end > self.num_blocks:
            raise ValueError(f"blocks [{first}, {end}) are outside the pool's {self.num_blocks}")
        t = self.tokens_per_block
        for layer, cached in zip(self.layers, cache.layers, strict=True):
            for side, states in enumerate((cached.keys, cached.values)):
                # [1, h, tokens, d] -> [n, t, h, d]
                blocks = states[0, :, first * t : end * t].to(self.device)
                blocks = blocks.reshape(self.num_kv_heads, end - first, t, self.head_dim)
                layer[first:end, side].copy_(blocks.permute(1, 2, 0, 3))
