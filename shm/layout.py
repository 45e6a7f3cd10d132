"""Where each byte of a KV block lives in a CPU-tier slot.

A CPU block holds every TP rank's shard side by side; each shard is
layer-major (layer 0's bytes of that block, then layer 1's, ...):

    slot: [rank 0: layer 0 | layer 1 | ... ][rank 1: layer 0 | ... ] ... [padding]

so one block is one contiguous region for SSD and remote I/O, and each rank
writes a disjoint part of it. Slots are `slot_stride` bytes apart, a whole
number of pages, so every slot starts page-aligned.

Imports no torch at module level: the sidecar daemon uses this without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PAGE_BYTES = 4096


@dataclass(frozen=True)
class BlockLayout:
    """The byte layout of one KV block across layers and TP ranks.

    `layer_block_bytes` is the size of ONE block of ONE layer in one rank's
    paged KV tensor: prod(block_shape) * itemsize. An engine that keeps K and
    V in separate tensors counts each as a layer here (2 * num_layers).
    """

    num_layers: int
    layer_block_bytes: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "layer_block_bytes", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockLayout.{name} must be a positive int, got {value!r}")

    @property
    def shard_bytes(self) -> int:
        """One rank's part of a block: all its layers."""
        return self.num_layers * self.layer_block_bytes

    @property
    def block_bytes(self) -> int:
        """A whole block: every rank's shard."""
        return self.tp_size * self.shard_bytes

    @property
    def slot_stride(self) -> int:
        """Distance between slots: block_bytes rounded up to whole pages."""
        return -(-self.block_bytes // PAGE_BYTES) * PAGE_BYTES

    def offset(self, rank: int, layer: int) -> int:
        """Byte offset, within a slot, of `rank`'s bytes of `layer`."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} out of range 0..{self.tp_size - 1}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        return rank * self.shard_bytes + layer * self.layer_block_bytes

    @classmethod
    def for_tensors(cls, kv_layers: Sequence[torch.Tensor], tp_size: int = 1) -> BlockLayout:
        """The layout of one rank's paged KV tensors, each shaped [num_blocks, ...].

        Only reads shapes and dtypes; `shm.copy` checks the tensors in full.
        """
        if len(kv_layers) == 0:
            raise ValueError("kv_layers is empty")
        first = kv_layers[0]
        if first.dim() < 1 or first.shape[0] == 0:
            raise ValueError(f"KV tensors must be shaped [num_blocks, ...], got {first.shape}")
        block_elems = math.prod(first.shape[1:])
        return cls(len(kv_layers), block_elems * first.element_size(), tp_size)
