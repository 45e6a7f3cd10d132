"""`KVGeometry`: one rank's paged KV cache as vLLM (0.33) hands it over, and
as both connector halves agree on it.

vLLM gives each layer a 4D view `[B, H, N, C]` (blocks, heads, tokens, K and
V content; H = 1 for MLA) whose memory order is the engine's resolved
`KVCacheLayout`, an order of the logical axes `[L, B, H, N, C]`. Every one
is supported, each view copied in place with strided copies (cuda_ext's
"strided" layout, cuda_ext/runs.py):

| layout | a block of a layer is | runs per block and layer |
|---|---|---|
| `LBHNC`, `LBNHC` | a page in its layer's run of blocks | one |
| `LHBNC` (head-outer) | a `[N, C]` run in each head's run of blocks | H |
| `BLHNC`, `BLNHC` (cross-layer) | a page of a block of every layer | one (a block: one copy) |
| `BHLNC` (cross-layer, head-outer) | a `[N, C]` run per head in the block | H |

Padded pages (`page_size_padded`) only move blocks further apart: the
padding is never copied. Where attention kernels use smaller blocks, their
views are regrouped into vLLM's blocks, except where that would order a
block's bytes unlike an unsplit engine's (LBHNC, several heads): refused.
A slot holds a block's layers one after another, each in its memory order;
the layout goes into the namespace, so engines whose blocks order their
bytes differently never share a block.

The scheduler has no KV tensors: it registers a two-block stand-in of the
geometry, laid out alike, so its lookups hash into the same namespace as the
workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cuda_ext.runs import block_runs
from engine_shim.kvconnector.settings import ConnectorSettings

LAYOUT_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""Supported vLLM KV cache layouts: the memory order of the logical axes
[L, B, H, N, C] (vLLM's `KVCacheLayout` values)."""
_L, _B, _H, _N = 0, 1, 2, 3


@dataclass(frozen=True)
class KVGeometry:
    layout: str
    """vLLM's KVCacheLayout name, one of LAYOUT_ORDERS."""
    num_layers: int
    block_size: int
    """Tokens per (scheduler) block."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_elems: int
    """Elements of one layer's block, padding excluded (vLLM's unpadded page
    size / dtype size)."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUT_ORDERS:
            raise ValueError(
                f"KV cache layout {self.layout!r} is not supported: set "
                f"VLLM_KV_CACHE_LAYOUT to one of {sorted(LAYOUT_ORDERS)}"
            )
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "block_elems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.block_elems % self.runs_per_block:
            raise ValueError(
                f"a {self.layout} block of {self.block_elems} elements does not split "
                f"into {self.num_kv_heads} heads"
            )

    @property
    def runs_per_block(self) -> int:
        """Contiguous runs of one layer's block: one per head where heads lie
        outside the blocks (LHBNC, BHLNC), else one."""
        order = LAYOUT_ORDERS[self.layout]
        heads_outside = order.index(_H) < max(order.index(_L), order.index(_B))
        return self.num_kv_heads if heads_outside else 1

    @property
    def layer_splits(self) -> tuple[int, ...]:
        """Layer counts a layer-wise copy may stop at: every layer where each
        layer has blocks of its own, only all of them in a cross-layer
        layout (a block is one copy). cuda_ext's `KVPlanes.layer_splits` of
        the registered tensors may be finer, never coarser."""
        order = LAYOUT_ORDERS[self.layout]
        if order.index(_B) < order.index(_L):
            return (self.num_layers,)
        return tuple(range(1, self.num_layers + 1))

    def stand_in(
        self, num_blocks: int = 2, device: str | torch.device = "cpu"
    ) -> list[torch.Tensor]:
        """Per-layer views of one zeroed allocation of `num_blocks` blocks in
        this geometry's layout, unpadded: the same runs as the workers'
        tensors. The scheduler registers two blocks on CPU (with one, the runs
        of a head-outer layout would lie end to end); `bench shm` / `bench
        gpu` copy many."""
        runs = self.runs_per_block  # the heads, where they are runs of their own
        shape = (self.num_layers, num_blocks, runs, 1, self.block_elems // runs)
        strides, step = [0] * 5, 1
        for dim in reversed(LAYOUT_ORDERS[self.layout]):
            strides[dim], step = step, step * shape[dim]
        memory = torch.zeros(step, dtype=self.dtype, device=device)
        full = memory.as_strided(shape, strides)
        return [full[layer] for layer in range(self.num_layers)]

    def planes(self, kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """vLLM's `{layer name: [B, H, N, C] view}`, checked against this
        geometry, as the views to register with cuda_ext's "strided" layout
        (kernel blocks regrouped into vLLM's blocks; never a copy).
        ValueError, saying what differs, for tensors of another geometry."""
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty {layer name: tensor} mapping")
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV tensors for {self.num_layers} layers")
        return [self._view(name, t) for name, t in kv_caches.items()]

    def _view(self, name: str, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"KV of {name} must be a 4D [B, H, N, C] tensor, not {got}")
        if t.dtype != self.dtype:
            raise ValueError(f"KV of {name} is {t.dtype}, the KV cache spec says {self.dtype}")
        wrong = (
            f"KV of {name} (shape {tuple(t.shape)}, strides {t.stride()}) is not a "
            f"{self.layout} view of {self.block_elems}-element blocks"
        )
        hint = f": set VLLM_KV_CACHE_LAYOUT to one of {sorted(LAYOUT_ORDERS)}"
        physical = [i - 1 for i in LAYOUT_ORDERS[self.layout] if i != _L]
        strides = [t.stride(d) for d in physical if t.shape[d] > 1]
        if strides != sorted(strides, reverse=True):
            raise ValueError(f"{wrong} (its memory order differs){hint}")
        view = self._manager_blocks(name, t, wrong)
        try:
            runs = block_runs(view)
        except ValueError as err:
            raise ValueError(f"{wrong}: {err}") from None
        run_elems = self.block_elems // self.runs_per_block
        if len(runs) != self.runs_per_block or runs[0].shape[1] != run_elems:
            raise ValueError(
                f"{wrong}: its blocks copy as {len(runs)} runs of {runs[0].shape[1]} elements, "
                f"not {self.runs_per_block} of {run_elems}{hint}"
            )
        return view

    def _manager_blocks(self, name: str, t: torch.Tensor, wrong: str) -> torch.Tensor:
        """`t` with vLLM's blocks on dimension 0: where attention kernels use
        smaller blocks, `ratio` consecutive kernel blocks form one. Refused
        where that reorders a block's bytes (heads before tokens, several
        heads): an engine without the split would share blocks it reads
        differently, and the scheduler cannot tell the two apart."""
        tokens = int(t.shape[2])
        if tokens == self.block_size:
            return t
        if tokens == 0 or self.block_size % tokens or t.shape[0] % (self.block_size // tokens):
            raise ValueError(f"{wrong}: blocks of {tokens} tokens, not {self.block_size}")
        order = LAYOUT_ORDERS[self.layout]
        if t.shape[1] > 1 and order.index(_H) < order.index(_N):
            raise ValueError(
                f"KV of {name}: the attention kernels split each "
                f"{self.block_size}-token block into blocks of {tokens} tokens, which in "
                f"{self.layout} orders a block's bytes unlike an engine without the split "
                f"(both would share blocks): set VLLM_KV_CACHE_LAYOUT=LBNHC or "
                f"--block-size {tokens}"
            )
        ratio = self.block_size // tokens
        shape = (t.shape[0] // ratio, ratio, *t.shape[1:])
        return t.as_strided(shape, (t.stride(0) * ratio, *t.stride()), t.storage_offset())

    def register_args(self, settings: ConnectorSettings) -> dict[str, Any]:
        """KVClient.register keywords (besides the planes) for this geometry."""
        return {
            "model_name": settings.model_name,
            "model_revision": settings.model_revision,
            "tokens_per_block": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layout": "strided",
            "layout_detail": f"vllm:{self.layout}",
            "tenant": settings.tenant,
        }
