"""One small KV cache in every engine layout, for the cuda_ext tests, and
why the GPU tests cannot run here."""

from __future__ import annotations

import numpy as np
import torch

from cuda_ext import _lib

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 3, 12, 4, 2, 8
DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern, NaNs included: the copies move bytes, not values."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    last = shape[-1] * itemsize
    return torch.randint(0, 256, (*shape[:-1], last), dtype=torch.uint8, generator=gen).view(dtype)


def logical_kv(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[layers, blocks, K/V, tokens, heads, dim]: the KV every layout below holds."""
    gen = torch.Generator().manual_seed(seed)
    return random_bytes((LAYERS, BLOCKS, 2, TOKENS, HEADS, DIM), dtype, gen)


PAD = 16
"""Elements of padding after each page of the padded layouts ("strided")."""


def engine_kv(layout: str, kv: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """`kv` in an engine's layout, as fresh tensors on kv's device: contiguous,
    but for "strided": per layer a `[blocks, 2, tokens, heads, dim]` view of
    K/V-outer memory whose pages are padded (each block's K and V a run of
    its own, PAD elements apart)."""
    if layout == "strided":
        page = TOKENS * HEADS * DIM
        views = []
        for layer in range(LAYERS):
            memory = torch.zeros(2, BLOCKS, page + PAD, dtype=kv.dtype, device=kv.device)
            view = memory[:, :, :page].unflatten(2, (TOKENS, HEADS, DIM)).transpose(0, 1)
            view.copy_(kv[layer])
            views.append(view)
        return views
    if layout == "vllm_flash":
        return [kv[layer].transpose(0, 1).contiguous() for layer in range(LAYERS)]
    if layout == "flashinfer":
        return [kv[layer].contiguous() for layer in range(LAYERS)]
    if layout == "cross_layer":
        return kv.transpose(0, 1).contiguous()
    if layout == "block_major":
        return [kv[layer].reshape(BLOCKS, -1).contiguous() for layer in range(LAYERS)]
    assert layout == "mla"  # one latent vector per token: the K/V split reinterpreted
    return [kv[layer].reshape(BLOCKS, TOKENS, -1).contiguous() for layer in range(LAYERS)]


def raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1).copy()


def expected_shard(kv: torch.Tensor, block: int) -> np.ndarray:
    """One rank's slot bytes for `block`: layer 0 K, layer 0 V, layer 1 K, ..."""
    return np.concatenate([raw(kv[layer, block]) for layer in range(LAYERS)])


def why_no_gpu() -> str | None:
    """Why the GPU tests are skipped here; None when they can run."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: no GPU here (run on a GPU machine)"
    try:
        _lib.probe()
    except _lib.GpuUnavailable as exc:
        return f"libkvcopy.so cannot run: {exc}"
    return None


# vLLM 0.33's KVCacheLayout names: the memory order of the logical axes
# [L, B, H, N, C] (layers, blocks, heads, tokens, K and V content).
VLLM_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
FILL = 0x5A
"""The byte vLLM-layout buffers start as: padding must still hold it after loads."""


def vllm_strides(shape: tuple[int, ...], layout: str, padded_page: int | None) -> list[int]:
    """Element strides, in [L, B, H, N, C] order, of one allocation in `layout`:
    dense in memory order, except that the innermost of L and B (where a
    page ends) steps by at least `padded_page` elements (vLLM's
    `page_size_padded`, allowed where heads lie inside the page)."""
    order = VLLM_ORDERS[layout]
    page_end = max(order.index(0), order.index(1))
    strides, step = [0] * 5, 1
    for position in reversed(range(5)):
        dim = order[position]
        if padded_page is not None and position == page_end:
            step = max(step, padded_page)
        strides[dim] = step
        step *= shape[dim]
    return strides


def vllm_views(
    kv: torch.Tensor, layout: str, padded_page: int | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`kv` ([L, B, H, N, C]) copied into one allocation in vLLM `layout`, as
    vLLM hands it to a connector: (the allocation, every byte FILL first; per
    layer a [B, H, N, C] view of it)."""
    strides = vllm_strides(tuple(kv.shape), layout, padded_page)
    size = 1 + sum((n - 1) * s for n, s in zip(kv.shape, strides, strict=True))
    memory = torch.empty(size, dtype=kv.dtype, device=kv.device)
    memory.view(torch.uint8).fill_(FILL)
    full = memory.as_strided(tuple(kv.shape), strides)
    full.copy_(kv)
    return memory, [full[layer] for layer in range(kv.shape[0])]


def vllm_block_bytes(kv: torch.Tensor, layout: str, layer: int, block: int) -> np.ndarray:
    """One layer's bytes of one block as a slot holds them: [H, N, C], or
    [N, H, C] where tokens lie outside heads (LBNHC, BLNHC)."""
    page = kv[layer, block]
    order = VLLM_ORDERS[layout]
    return raw(page.transpose(0, 1) if order.index(3) < order.index(2) else page)


def vllm_shard(kv: torch.Tensor, layout: str, block: int) -> np.ndarray:
    """One rank's slot bytes for `block`: its layers one after another."""
    return np.concatenate(
        [vllm_block_bytes(kv, layout, layer, block) for layer in range(kv.shape[0])]
    )


def padding_mask(memory: torch.Tensor, views: list[torch.Tensor]) -> torch.Tensor:
    """uint8 mask of `memory`'s bytes no view covers (1: padding)."""
    mask = torch.ones(memory.numel() * memory.element_size(), dtype=torch.uint8)
    payload = torch.zeros_like(memory, device="cpu").view(torch.uint8)
    shadow = payload.view(memory.dtype)
    for view in views:
        shadow.as_strided(view.shape, view.stride(), view.storage_offset()).view(torch.uint8).fill_(
            1
        )
    return mask - payload
