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


MAX_PAIRS = 1 << 22
"""Pairs of planes whose address ranges meet that check_disjoint tests one by
one; past that (thousands of interleaved planes) it tests their offsets
within one block stride instead."""


def check_disjoint(planes: Sequence[torch.Tensor]) -> None:
    """ValueError if two uint8 planes `[num_blocks, chunk]` (rows contiguous)
    share a byte. Only planes whose address ranges meet are compared: exactly
    for planes of one block stride, by those ranges for planes of two."""
    if len(planes) < 2:
        return
    num_blocks, chunk = int(planes[0].shape[0]), int(planes[0].shape[1])
    bases = np.array([p.data_ptr() for p in planes], dtype=np.int64)
    strides = np.array([p.stride(0) if num_blocks > 1 else chunk for p in planes], np.int64)
    order = np.argsort(bases, kind="stable")
    ends = bases + strides * (num_blocks - 1) + chunk
    # Plane order[k] can meet only the planes after it that start before it ends.
    reach = np.searchsorted(bases[order], ends[order], side="left")
    counts = np.maximum(reach - np.arange(len(planes)) - 1, 0)
    total = int(counts.sum())
    if total > MAX_PAIRS:
        _check_offsets(bases, strides, chunk)
        return
    first = np.repeat(np.arange(len(planes)), counts)
    step = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    i, j = order[first], order[first + 1 + step]
    delta, stride = bases[j] - bases[i], strides[i]
    # One stride: block b of plane i meets block b' of plane j where
    # |delta - (b - b') * stride| < chunk; that distance is convex in k = b - b',
    # so the k in range nearest delta / stride decides.
    below = np.floor_divide(delta, stride)
    gap = np.minimum(
        *(
            np.abs(delta - np.clip(k, 1 - num_blocks, num_blocks - 1) * stride)
            for k in (below, below + 1)
        )
    )
    # Planes of two strides whose ranges meet are refused: no engine makes them.
    clash = np.flatnonzero((strides[i] != strides[j]) | (gap < chunk))
    if clash.size:
        _shared(int(i[clash[0]]), int(j[clash[0]]))


def _check_offsets(bases: np.ndarray, strides: np.ndarray, chunk: int) -> None:
    """Planes of one block stride whose chunks start at distinct offsets
    within it, none reaching the next: then no two share a byte."""
    if (strides != strides[0]).any():
        raise ValueError("too many interleaved KV planes of different block strides to check")
    offsets = bases % strides[0]
    order = np.argsort(offsets, kind="stable")
    ordered = offsets[order]
    gaps = np.append(np.diff(ordered), ordered[0] + strides[0] - ordered[-1])
    bad = np.flatnonzero(gaps < chunk)
    if bad.size:
        a, b = sorted((int(order[bad[0]]), int(order[(bad[0] + 1) % len(order)])))
        raise ValueError(
            f"planes {a} and {b} of the KV may share memory: their chunks start too close "
            f"within a block stride, and the {len(bases)} planes interleave too much to "
            "check pair by pair"
        )


def _shared(a: int, b: int) -> None:
    raise ValueError(
        f"planes {min(a, b)} and {max(a, b)} of the KV share memory (two tensors over the "
        "same bytes?): a copy into one would overwrite the other"
    )


def _s(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}"
