"""The contiguous runs of a strided KV tensor's blocks, and checks that planes
never share a byte.

A tensor whose dimension 0 indexes blocks, with any strides (vLLM 0.33's
per-layer `[B, H, N, C]` views in every `KVCacheLayout`, padded pages), holds
each block as one or more equal *runs* of contiguous memory: its dimensions
other than 0, in memory order (largest stride first), merged from the
innermost while each lies right after the next. The dimensions left over
count the runs. Every run is then a plane `[num_blocks, run]` whose block
stride is the tensor's, and a block's runs in memory order are its bytes in
a slot:

| vLLM layout (per-layer view `[B, H, N, C]`) | runs of a block of a layer |
|---|---|
| `LBHNC`, `BLHNC` (cross-layer) | one: `[H, N, C]` |
| `LBNHC`, `BLNHC` (cross-layer) | one: `[N, H, C]` |
| `LHBNC` (head-outer), `BHLNC` | H: `[N, C]` of each head |

A padded page only widens the block stride: the padding is never copied.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch


def block_runs(t: torch.Tensor) -> list[torch.Tensor]:
    """The runs of `t`'s blocks as views `[num_blocks, run]` of t's memory in
    its dtype, in memory order (never a copy). ValueError, saying why, when
    the innermost dimension is not contiguous or two elements share memory."""
    if t.dim() < 1:
        raise ValueError("a scalar holds no blocks")
    num_blocks = int(t.shape[0])
    inner = sorted(
        ((int(t.shape[d]), int(t.stride(d))) for d in range(1, t.dim()) if t.shape[d] > 1),
        key=lambda dim: -dim[1],
    )
    _check_no_overlap(t, inner)
    run, outer = 1, list(inner)
    while outer and outer[-1][1] == run:
        run *= outer.pop()[0]
    if inner and run == 1:
        raise ValueError(
            f"tensor {_s(t)} has no contiguous innermost dimension: its blocks would "
            "copy element by element"
        )
    block_stride = int(t.stride(0)) if num_blocks > 1 else run
    runs = []
    for index in itertools.product(*(range(size) for size, _ in outer)):
        offset = sum(i * stride for i, (_, stride) in zip(index, outer, strict=True))
        runs.append(t.as_strided((num_blocks, run), (block_stride, 1), t.storage_offset() + offset))
    return runs


def _check_no_overlap(t: torch.Tensor, inner: list[tuple[int, int]]) -> None:
    """Every element of `t` at its own address: each dimension's stride
    clears the extent of all those with smaller strides (a sufficient test)."""
    dims = [(int(t.shape[0]), int(t.stride(0)))] if t.shape[0] > 1 else []
    extent = 1
    for size, stride in sorted(dims + inner, key=lambda dim: dim[1]):
        if stride < extent:
            raise ValueError(
                f"tensor {_s(t)} with strides {t.stride()} maps two elements to the "
                "same memory: it is not a KV cache whose blocks can be copied"
            )
        extent += (size - 1) * stride


def check_disjoint(planes: Sequence[torch.Tensor]) -> None:
    """ValueError if two uint8 planes `[num_blocks, chunk]` (rows contiguous)
    share a byte. Planes of one block stride are checked exactly; planes of
    different strides must not share an address range."""
    if len(planes) < 2:
        return
    num_blocks, chunk = int(planes[0].shape[0]), int(planes[0].shape[1])
    bases = np.array([p.data_ptr() for p in planes], dtype=np.int64)
    strides = np.array([p.stride(0) if num_blocks > 1 else chunk for p in planes], np.int64)
    i, j = np.triu_indices(len(planes), k=1)
    delta, stride = bases[j] - bases[i], strides[i]
    # Same stride: block b of plane i meets block b' of plane j where
    # |delta - (b - b') * stride| < chunk; |delta - k * stride| is convex in
    # k, so the k in range nearest delta / stride decides.
    below = np.floor_divide(delta, stride)
    gap = np.minimum(
        *(
            np.abs(delta - np.clip(k, 1 - num_blocks, num_blocks - 1) * stride)
            for k in (below, below + 1)
        )
    )
    same = strides[i] == strides[j]
    span = strides * (num_blocks - 1) + chunk
    apart = (bases[i] >= bases[j] + span[j]) | (bases[j] >= bases[i] + span[i])
    clash_same, clash_other = same & (gap < chunk), ~same & ~apart
    clash = np.flatnonzero(clash_same | clash_other)
    if clash.size:
        a, b = int(i[clash[0]]), int(j[clash[0]])
        raise ValueError(
            f"planes {a} and {b} of the KV share memory (two tensors over the same "
            "bytes?): a copy into one would overwrite the other"
        )


def _s(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}"
