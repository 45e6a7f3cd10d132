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
