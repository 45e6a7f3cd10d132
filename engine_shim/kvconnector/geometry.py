"""`KVGeometry`: one rank's paged KV cache as vLLM (0.33) hands it over, and
as both connector halves agree on it.

vLLM gives each layer a 4D view `[B, H, N, C]` (blocks, heads, tokens, K and
V content; H = 1 for MLA) whose physical order is the engine's resolved
`KVCacheLayout`. In the layer-compact layouts supported here ("LBHNC",
"LBNHC") each layer is one contiguous run of blocks, so the layer is a
block-major plane of `block_elems` elements per block: cuda_ext's
"block_major" layout. The physical order goes into the namespace, so two
engines whose blocks order their bytes differently never share a block.

The scheduler has no KV tensors: it registers a one-block stand-in of the
geometry, so its lookups hash into the same namespace as the workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine_shim.kvconnector.settings import ConnectorSettings

PHYSICAL_ORDERS = {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3)}
"""Supported vLLM KV cache layouts: the permutation of a layer's [B, H, N, C]
view that is its memory order."""


@dataclass(frozen=True)
class KVGeometry:
    layout: str
    """vLLM's KVCacheLayout name, one of PHYSICAL_ORDERS."""
    num_layers: int
    block_size: int
    """Tokens per (scheduler) block."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_elems: int
    """Elements of one layer's block (vLLM's page size / dtype size)."""

    def __post_init__(self) -> None:
        if self.layout not in PHYSICAL_ORDERS:
            raise ValueError(
                f"KV cache layout {self.layout!r} is not supported: set "
                f"VLLM_KV_CACHE_LAYOUT to one of {sorted(PHYSICAL_ORDERS)}"
            )
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "block_elems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    def stand_in(self) -> list[torch.Tensor]:
        """One-block CPU planes of this geometry (what the scheduler registers)."""
        return [torch.zeros(1, self.block_elems, dtype=self.dtype) for _ in range(self.num_layers)]

    def planes(self, kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """vLLM's `{layer name: [B, H, N, C] view}` as block-major planes
        `[num_blocks, block_elems]` over the same memory (never a copy).
        ValueError, saying what differs, for tensors of another geometry."""
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty {layer name: tensor} mapping")
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV tensors for {self.num_layers} layers")
        return [self._plane(name, t) for name, t in kv_caches.items()]

    def _plane(self, name: str, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"KV of {name} must be a 4D [B, H, N, C] tensor, not {got}")
        if t.dtype != self.dtype:
            raise ValueError(f"KV of {name} is {t.dtype}, the KV cache spec says {self.dtype}")
        physical = t.permute(*PHYSICAL_ORDERS[self.layout])
        if not physical.is_contiguous() or t.numel() % self.block_elems:
            raise ValueError(
                f"KV of {name} (shape {tuple(t.shape)}, strides {t.stride()}) is not a "
                f"contiguous {self.layout} run of {self.block_elems}-element blocks: set "
                f"VLLM_KV_CACHE_LAYOUT to one of {sorted(PHYSICAL_ORDERS)}"
            )
        return physical.reshape(-1, self.block_elems)

    def register_args(self, settings: ConnectorSettings) -> dict[str, Any]:
        """KVClient.register keywords (besides the planes) for this geometry."""
        return {
            "model_name": settings.model_name,
            "model_revision": settings.model_revision,
            "tokens_per_block": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layout": "block_major",
            "layout_detail": f"vllm:{self.layout}",
            "tenant": settings.tenant,
        }
