"""`PagedKV`: the engine-side paged KV pool the HF adapter registers with the
sidecar, and the copies between it and a transformers `DynamicCache`.

One tensor per layer on the model's device, laid out as a DynamicCache
layer holds its keys and values (a CUDA pool is copied to and from the
sidecar's shm by cuda_ext's GPU copier; a CPU pool by the C copy):

    kv[i][0] = keys,   [num_kv_heads, num_blocks * tokens_per_block, head_dim]
    kv[i][1] = values, [num_kv_heads, num_blocks * tokens_per_block, head_dim]

so the DynamicCache of a loaded prefix is views of the pool, with no copy.
The sidecar sees each layer's blocks through `layers[i]`, a view
[num_blocks, 2, num_kv_heads, tokens_per_block, head_dim] of the same
memory, registered as the `strided` layout: a block is 2 x num_kv_heads
runs of tokens_per_block x head_dim elements a layer.

The pool holds one prompt at a time: pool block j holds the prompt's j-th
block of tokens, so a block id is simply the block's index in the prompt.
Keys are stored after RoPE, exactly as the model caches them, so loaded keys
need no rotation.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer


class PagedKV:
    LAYOUT = "strided"
    """How `layers` is registered with the sidecar (cuda_ext.layouts)."""

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
        shape = (2, num_kv_heads, num_blocks * tokens_per_block, head_dim)
        self.device = torch.device(device)
        self.kv = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        blocks = (2, num_kv_heads, num_blocks, tokens_per_block, head_dim)
        self.layers = [kv.view(blocks).permute(2, 0, 1, 3, 4) for kv in self.kv]
        """Per layer, the view the sidecar copies blocks through (LAYOUT)."""
        self._keys_values = [(kv[0].unsqueeze(0), kv[1].unsqueeze(0)) for kv in self.kv]
        """Per layer, the whole pool as a DynamicLayer holds its keys and
        values: [1, num_kv_heads, tokens, head_dim]."""
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
        num_blocks * tokens_per_block tokens (empty for 0): views of the pool.

        For a model whose every layer is full attention (all that CachedLM
        takes; `config` must say so): each layer is a `DynamicLayer` given
        the pool's keys and values as they are. `DynamicCache.update` would
        copy them (a `cat` onto an empty tensor), and building the cache from
        `config` reads it through transformers' attribute hooks. The model's
        forward never writes into them: it concatenates its new tokens into
        tensors of its own.

        Each layer is set up as its `lazy_initialization` would (dtype,
        device, initialized) without the two empty tensors that makes and
        the keys and values then replace: a third of the time for the
        same cache (32 layers on this VM's CPU: 0.10 ms against 0.33)."""
        if not 0 <= num_blocks <= self.num_blocks:
            raise ValueError(f"num_blocks must be in [0, {self.num_blocks}], got {num_blocks}")
        if num_blocks == 0:
            return DynamicCache(config=config)
        cache = DynamicCache()
        tokens = num_blocks * self.tokens_per_block
        for keys, values in self._keys_values:
            filled = DynamicLayer()  # type: ignore[no-untyped-call]
            filled.dtype, filled.device, filled.is_initialized = keys.dtype, keys.device, True
            filled.keys, filled.values = keys.narrow(2, 0, tokens), values.narrow(2, 0, tokens)
            cache.layers.append(filled)
        return cache

    def from_cache(self, cache: DynamicCache, first: int, end: int) -> None:
        """Copy blocks [first, end) of the prompt from `cache` (holding at
        least end * tokens_per_block tokens) into the pool."""
        if end <= first:
            return
        if first < 0 or end > self.num_blocks:
            raise ValueError(f"blocks [{first}, {end}) are outside the pool's {self.num_blocks}")
        a, b = first * self.tokens_per_block, end * self.tokens_per_block
        for kv, cached in zip(self.kv, cache.layers, strict=True):
            keys, values = layer_kv(cached)
            kv[0, :, a:b].copy_(keys[0, :, a:b])
            kv[1, :, a:b].copy_(values[0, :, a:b])


def layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a filled full-attention cache layer (what a
    `DynamicLayer` holds once the forward ran)."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise ValueError(f"the cache layer {type(layer).__name__} holds no keys and values")
    return keys, values
