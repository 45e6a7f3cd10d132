"""Every engine KV-cache layout as a list of block-major *planes*.

A plane is a tensor whose first dimension indexes blocks and whose per-block
*chunk* is contiguous; all planes of one rank have the same chunk size. Copies
then need one rule for every layout: chunk (plane p, block b) of a rank goes
to that rank's shard of the block's CPU slot at p * chunk_bytes (shm.layout's
BlockLayout with num_layers = number of planes, layer_block_bytes = chunk bytes).

| layout        | engine tensors (one rank)              | planes                          |
|---------------|----------------------------------------|---------------------------------|
| `block_major` | per layer `[N, ...]`                   | the tensors                     |
| `vllm_flash`  | per layer `[2, N, bs, heads, dim]`     | per layer: t[0] (K), t[1] (V)   |
| `flashinfer`  | per layer `[N, 2, bs, heads, dim]`     | the tensors                     |
| `cross_layer` | one `[N, layers, ...]` for all layers  | that tensor                     |
| `mla`         | per layer `[N, bs, latent]`            | the tensors                     |
| `strided`     | per layer `[N, ...]`, any strides      | per layer: its runs (runs.py)   |

`paged` (the engine shim's historical name) means `block_major`. For the same
KV, vllm_flash, flashinfer and cross_layer (`[N, layers, 2, bs, heads, dim]`)
give the same slot bytes: layer 0 K, layer 0 V, layer 1 K, ...

`strided` takes vLLM 0.33's per-layer `[B, H, N, C]` views as they are, in
every `KVCacheLayout`: each layer's blocks as their contiguous runs
(cuda_ext.runs: one per block, or one per head when heads lie outside the
blocks, as in `LHBNC`), the block stride whatever the layout makes it (the
other layers of a cross-layer block, a padded page), never the padding.
`cross_layer` takes one `[N, layers, ...]` tensor whose blocks may be padded.
Planes never share a byte (checked); the copiers merge planes that lie end to
end in every block (a cross-layer block's layers) into one chunk
(`KVPlanes.coalesced`), with the same slot bytes.

Planes are uint8 views `[N, chunk_bytes]` of the engine's memory (row
stride `block_strides`, at least chunk_bytes), so fp8 and every other dtype
copy as bytes; `KVPlanes.dtype` keeps the engine's dtype for the namespace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cuda_ext.runs import block_runs, check_disjoint
from shm.layout import BlockLayout

LAYOUTS = ("block_major", "vllm_flash", "flashinfer", "cross_layer", "mla", "strided")
ALIASES = {"paged": "block_major"}


@dataclass(frozen=True)
class KVPlanes:
    """One rank's KV cache as planes, and which planes hold which model layer."""

    layout: str
    planes: tuple[torch.Tensor, ...]
    """uint8 views [num_blocks, chunk_bytes] of the engine's tensors, slot
    order; each row contiguous, rows `block_strides` bytes apart."""
    dtype: torch.dtype
    """The engine tensors' dtype (fp8 included), for the namespace."""
    layer_ends: tuple[int, ...]
    """For model layer l, the plane index just past the last plane holding it:
    once planes [0, layer_ends[l]) have landed, layer l has."""

    @property
    def num_layers(self) -> int:
        """Model layers (not planes)."""
        return len(self.layer_ends)

    @property
    def num_blocks(self) -> int:
        return int(self.planes[0].shape[0])

    @property
    def chunk_bytes(self) -> int:
        return int(self.planes[0].shape[1])

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def block_strides(self) -> tuple[int, ...]:
        """Bytes from one block of each plane to the next (chunk_bytes when
        the plane is contiguous; more for a padded page or a cross-layer block)."""
        if self.num_blocks == 1:
            return (self.chunk_bytes,) * len(self.planes)
        return tuple(int(p.stride(0)) for p in self.planes)

    @property
    def layer_splits(self) -> tuple[int, ...]:
        """Where a layer-wise copy may split the model layers: l is one when no
        plane holds both a layer before l and one from l on (every layer in
        a layer-major layout; only the last for a cross-layer block)."""
        ends, last = self.layer_ends, len(self.layer_ends)
        return tuple(i + 1 for i in range(last) if i + 1 == last or ends[i] < ends[i + 1])

    def plane_range(self, layers: tuple[int, int]) -> tuple[int, int]:
        """The planes holding model layers [begin, end) and no other layer;
        ValueError if a plane holds one of them and another (split the
        layers at `layer_splits` only)."""
        if (
            not isinstance(layers, tuple)
            or len(layers) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
            or not 0 <= layers[0] < layers[1] <= self.num_layers
        ):
            raise ValueError(f"layers must be (begin, end) in 0..{self.num_layers}, got {layers!r}")
        begin, end = layers
        if (begin and begin not in self.layer_splits) or end not in self.layer_splits:
            raise ValueError(
                f"layers {begin}..{end - 1} share planes with other layers: "
                f"split at {self.layer_splits} only"
            )
        return (self.layer_ends[begin - 1] if begin else 0), self.layer_ends[end - 1]

    def coalesced(self) -> KVPlanes:
        """The same bytes as fewer, larger planes: each group of k consecutive
        planes that lie end to end in every block (a cross-layer block's
        layers) as one, k the largest such divisor of the plane count. A
        slot's bytes, and so `block_layout()`'s shard, stay the same; only
        the number of planes and their chunk change."""
        count, chunk = len(self.planes), self.chunk_bytes
        addrs = [p.data_ptr() for p in self.planes]
        strides = self.block_strides
        for k in range(count, 1, -1):
            if count % k == 0 and all(
                addrs[g + i + 1] == addrs[g + i] + chunk
                and strides[g + i + 1] == strides[g]
                and strides[g] >= k * chunk
                for g in range(0, count, k)
                for i in range(k - 1)
            ):
                merged = tuple(
                    self.planes[g].as_strided(
                        (self.num_blocks, k * chunk),
                        (strides[g], 1),
                        self.planes[g].storage_offset(),
                    )
                    for g in range(0, count, k)
                )
                ends = tuple(-(-end // k) for end in self.layer_ends)
                return KVPlanes(self.layout, merged, self.dtype, ends)
        return self

    def block_layout(self, tp_size: int = 1) -> BlockLayout:
        """The CPU slot layout these planes copy into."""
        return BlockLayout(len(self.planes), self.chunk_bytes, tp_size)


def as_planes(kv: torch.Tensor | Sequence[torch.Tensor], layout: str) -> list[torch.Tensor]:
    """The planes of `kv` in `layout` (see the module docstring)."""
    return list(kv_planes(kv, layout).planes)


def kv_planes(kv: torch.Tensor | Sequence[torch.Tensor], layout: str) -> KVPlanes:
    """Check `kv` against `layout` and describe it as planes. Raises TypeError
    or ValueError, saying what is wrong, for anything else; never copies."""
    name = ALIASES.get(layout, layout)
    if name not in LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    tensors = _tensors(kv, name)
    first = tensors[0]
    if first.numel() == 0:
        raise ValueError(f"{name} KV holds no blocks or empty blocks: {_s(first)}")
    if name == "strided":
        runs = [block_runs(t) for t in tensors]
        planes = [run for layer in runs for run in layer]
        ends = tuple(len(runs[0]) * (i + 1) for i in range(len(runs)))
    elif name == "vllm_flash":
        _expect(first, 5, "[2, num_blocks, block_size, kv_heads, head_dim]", 0)
        planes = [half for t in tensors for half in (t[0], t[1])]
        ends = tuple(2 * (i + 1) for i in range(len(tensors)))
    elif name == "cross_layer":
        if first.dim() < 3:
            raise ValueError(f"cross_layer KV is [num_blocks, num_layers, ...], not {_s(first)}")
        planes, ends = [first], (1,) * int(first.shape[1])
    else:
        if name == "flashinfer":
            _expect(first, 5, "[num_blocks, 2, block_size, kv_heads, head_dim]", 1)
        elif name == "mla":
            _expect(first, 3, "[num_blocks, block_size, latent_dim]", None)
        planes, ends = list(tensors), tuple(range(1, len(tensors) + 1))
    views = tuple(_bytes(p) for p in planes)
    check_disjoint(views)
    return KVPlanes(name, views, first.dtype, ends)


def _bytes(plane: torch.Tensor) -> torch.Tensor:
    """A plane whose rows are contiguous as uint8 `[num_blocks, row bytes]`."""
    row = math.prod(plane.shape[1:])
    stride = int(plane.stride(0)) if plane.shape[0] > 1 else row
    flat = plane.as_strided((plane.shape[0], row), (stride, 1), plane.storage_offset())
    return flat.view(torch.uint8)


def _tensors(kv: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    if isinstance(kv, torch.Tensor):
        if name != "cross_layer":
            raise TypeError(f"{name} KV is a sequence of per-layer tensors, not one tensor")
        tensors = [kv]
    elif isinstance(kv, Sequence) and len(kv) > 0:
        tensors = list(kv)
    else:
        raise TypeError(f"{name} KV must be a non-empty sequence of tensors")
    if name == "cross_layer" and len(tensors) != 1:
        raise ValueError(f"cross_layer KV is one tensor for all layers, got {len(tensors)}")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"KV tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"KV tensor {i} must be a dense CPU or CUDA tensor, not {_s(t)}")
        if t.is_conj() or t.is_neg():
            raise ValueError(f"KV tensor {i} is a conj/neg view: {_s(t)}")
        if name != "strided" and not _rows_contiguous(t, padded=name == "cross_layer"):
            raise ValueError(
                f"KV tensor {i} must be contiguous (a permuted or strided view is not a "
                f"paged cache this layout describes; the 'strided' layout takes any "
                f"strides): {_s(t)}"
            )
        if t.dim() == 0:
            raise ValueError(f"KV tensor {i} is a scalar, not a paged cache")
        if t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"KV tensor {i} has dtype {t.dtype}: not a KV cache dtype")
        if (t.dtype, t.shape, t.device) != (first.dtype, first.shape, first.device):
            raise ValueError(f"KV tensor {i} is {_s(t)} but tensor 0 is {_s(first)}")
        if name == "strided" and t.stride() != first.stride():
            raise ValueError(
                f"strided KV tensors must share their strides (so every layer's blocks "
                f"order their bytes alike): tensor {i} has {t.stride()}, tensor 0 {first.stride()}"
            )
    return tensors


def _rows_contiguous(t: torch.Tensor, *, padded: bool) -> bool:
    """Whether `t` is contiguous, or with `padded` its blocks are: each
    block contiguous, blocks at least a block apart."""
    if t.is_contiguous():
        return True
    if not padded or t.dim() < 2 or t.shape[0] < 2:
        return False
    return t[0].is_contiguous() and t.stride(0) >= t[0].numel()


def _expect(t: torch.Tensor, dims: int, shape: str, two_at: int | None) -> None:
    if t.dim() != dims or (two_at is not None and t.shape[two_at] != 2):
        raise ValueError(f"expected per-layer KV tensors shaped {shape}, got {_s(t)}")


def _s(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"
