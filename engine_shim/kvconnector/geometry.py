"""`KVGeometry`: the shape of one rank's paged KV cache, as both connector
halves see it. The scheduler has no KV tensors: it derives the geometry from
vLLM's KV cache spec and registers a one-block stand-in of it, so its
lookups hash into the same namespace as the workers' real tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine_shim.kvconnector.settings import VLLM_LAYOUTS, ConnectorSettings


@dataclass(frozen=True)
class KVGeometry:
    layout: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    """Per rank; 1 for MLA."""
    head_dim: int
    """The latent size for MLA."""
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.layout not in VLLM_LAYOUTS:
            raise ValueError(f"layout must be one of {VLLM_LAYOUTS}, got {self.layout!r}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.layout == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"MLA KV has one latent head, not {self.num_kv_heads}")

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's KV tensor of `num_blocks` blocks, in this layout."""
        block = (self.block_size, self.num_kv_heads, self.head_dim)
        if self.layout == "vllm_flash":
            return (2, num_blocks, *block)
        if self.layout == "flashinfer":
            return (num_blocks, 2, *block)
        return (num_blocks, self.block_size, self.head_dim)

    def stand_in(self) -> list[torch.Tensor]:
        """One-block CPU tensors of this geometry (what the scheduler registers)."""
        return [torch.zeros(self.layer_shape(1), dtype=self.dtype) for _ in range(self.num_layers)]

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """ValueError unless `tensors` are this geometry's KV tensors (any block count)."""
        if len(tensors) != self.num_layers:
            raise ValueError(f"{len(tensors)} KV tensors for a {self.num_layers}-layer geometry")
        for i, t in enumerate(tensors):
            dim = 0 if self.layout == "flashinfer" or self.layout == "mla" else 1
            n = int(t.shape[dim]) if isinstance(t, torch.Tensor) and t.dim() > dim else 0
            if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype) != (
                self.layer_shape(n),
                self.dtype,
            ):
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
                raise ValueError(
                    f"KV tensor {i} is {got}, not {self.dtype} {self.layer_shape(n)} "
                    f"({self.layout}): set kv_layout to the attention backend's layout"
                )

    def register_args(self, settings: ConnectorSettings) -> dict[str, Any]:
        """KVClient.register keywords (besides the tensors) for this geometry."""
        return {
            "model_name": settings.model_name,
            "model_revision": settings.model_revision,
            "tokens_per_block": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layout": self.layout,
            "tenant": settings.tenant,
        }
