"""vLLM 0.33's own KV cache views in every layout through the connector's
geometry and the copiers: the views `create_kv_cache_views` makes (padded
pages and kernel blocks included), the geometry `geometry_of` reads from a
`KVCacheConfig`, and a save / load round trip against plain indexing of
those views. It also checks that tests/kv_helpers.vllm_strides, which the
tests without vLLM build their views with, gives vLLM's strides.

Skipped where vLLM is not importable (CI installs none):
`python -m sideenv run vllm -- python -m pytest tests/test_vllm_layouts_vllm.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface", reason="vLLM is not installed here")

from kv_helpers import VLLM_ORDERS, random_bytes, raw, vllm_strides
from shm_helpers import checked_prefix
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from cuda_ext.copier import CpuBlockCopier
from cuda_ext.layouts import kv_planes
from engine_shim.vllm_connector import geometry_of
from shm.pool import ShmPool

LAYERS, NUM_BLOCKS, BLOCK, DIM = 3, 10, 8, 8
CASES = [
    (layout, heads, padded)
    for layout in VLLM_ORDERS
    for heads, padded in ((2, False), (1 if layout in ("LHBNC", "BHLNC") else 2, True))
]


def spec_of(heads: int, dtype: torch.dtype, padded: bool) -> FullAttentionSpec:
    page = heads * BLOCK * 2 * DIM * dtype.itemsize
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=DIM, dtype=dtype,
                             page_size_padded=page + 64 if padded else None)  # fmt: skip


def vllm_kv(layout: str, spec: FullAttentionSpec, kernel_block: int | None = None):
    """(vLLM's per-layer views over one int8 allocation, the KV cache config)."""
    order = KVCacheLayout[layout]
    strides = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, order)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    size = max(strides[0] * LAYERS, strides[1] * NUM_BLOCKS)
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=strides[0], block_stride=strides[1]
    )
    memory = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(memory, spec, NUM_BLOCKS, order, tensor, kernel_block)
    config = KVCacheConfig(
        NUM_BLOCKS, [tensor], [KVCacheGroupSpec(names, spec)], kv_cache_layout=layout
    )
    return dict(zip(names, views, strict=True)), config


@pytest.mark.parametrize("layout, heads, padded", CASES)
def test_the_helpers_strides_are_vllms(layout, heads, padded):
    spec = spec_of(heads, torch.float32, padded)
    shape = (LAYERS, NUM_BLOCKS, heads, BLOCK, 2 * DIM)
    pad = spec.page_size_padded // 4 if padded else None
    mine = [s * 4 for s in vllm_strides(shape, layout, pad)]  # in bytes, as vLLM's
    theirs = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, KVCacheLayout[layout])
    assert (*mine[:4], 1) == theirs  # vLLM counts C in bytes: its stride is 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout, heads, padded", CASES)
def test_vllms_views_copy_byte_exact_through_the_geometry(layout, heads, padded, dtype):
    spec = spec_of(heads, dtype, padded)
    views, config = vllm_kv(layout, spec)
    gen = torch.Generator().manual_seed(1)
    for view in views.values():
        view.copy_(random_bytes(tuple(view.shape), dtype, gen))
    geometry = geometry_of(config, None)  # the layout is resolved in the KV cache config
    assert geometry.block_elems == heads * BLOCK * 2 * DIM  # the payload, not the padding
    back, _ = vllm_kv(layout, spec)
    round_trip(geometry, views, back, [(3, 8), (0, 5), (9, 1)], kernel_ratio=1)


@pytest.mark.parametrize(("layout", "heads"), [("LBNHC", 2), ("LBHNC", 1)])
def test_kernel_blocks_regroup_into_vllms_blocks(layout, heads):
    """Attention kernels with smaller blocks than the scheduler's: vLLM's
    views index kernel blocks; ratio consecutive ones make a block, in the
    order an engine without the split has."""
    spec = spec_of(heads, torch.bfloat16, padded=False)
    views, config = vllm_kv(layout, spec, kernel_block=BLOCK // 2)
    assert next(iter(views.values())).shape[0] == 2 * NUM_BLOCKS
    gen = torch.Generator().manual_seed(2)
    for view in views.values():
        view.copy_(random_bytes(tuple(view.shape), torch.bfloat16, gen))
    back, _ = vllm_kv(layout, spec, kernel_block=BLOCK // 2)
    round_trip(geometry_of(config, None), views, back, [(2, 6), (7, 0)], kernel_ratio=2)


def round_trip(geometry, views, back, moves, *, kernel_ratio: int) -> None:
    """Save blocks `source` of `views`, load them into blocks `target` of
    `back`, and check every moved layer's bytes (kernel blocks
    kernel_ratio * b ...) by plain indexing."""
    planes = kv_planes(geometry.planes(views), "strided")
    layout = planes.block_layout()
    sources, targets = zip(*moves, strict=True)
    with checked_prefix("vllmviews") as prefix, ShmPool.create(prefix, 1 << 20) as pool:
        CpuBlockCopier(planes, pool).save(list(sources), [0, 1, 2][: len(moves)], layout, 0)
        restored = kv_planes(geometry.planes(back), "strided")
        CpuBlockCopier(restored, pool).load(list(targets), [0, 1, 2][: len(moves)], layout, 0)
    for source, target in moves:
        for name, view in views.items():
            for k in range(kernel_ratio):
                want = raw(view[kernel_ratio * source + k])
                assert np.array_equal(raw(back[name][kernel_ratio * target + k]), want)


def test_kernel_blocks_that_reorder_a_blocks_bytes_are_refused():
    """LBHNC with two heads: kernel blocks of 4 tokens make a block's bytes
    [2, H, 4, C], an unsplit engine's [H, 8, C]; sharing would mix them."""
    views, config = vllm_kv("LBHNC", spec_of(2, torch.bfloat16, padded=False), BLOCK // 2)
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBNHC or --block-size 4"):
        geometry_of(config, None).planes(views)
