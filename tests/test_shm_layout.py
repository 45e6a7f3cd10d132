"""BlockLayout: sizes, offsets that tile a block, validation, torch-free import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from shm.layout import PAGE_BYTES, BlockLayout


def test_sizes_and_stride():
    layout = BlockLayout(num_layers=32, layer_block_bytes=65536, tp_size=2)
    assert layout.shard_bytes == 32 * 65536
    assert layout.block_bytes == 2 * 32 * 65536
    assert layout.slot_stride == layout.block_bytes  # already whole pages
    assert BlockLayout(1, 1).slot_stride == PAGE_BYTES
    assert BlockLayout(1, PAGE_BYTES).slot_stride == PAGE_BYTES
    assert BlockLayout(1, PAGE_BYTES + 1).slot_stride == 2 * PAGE_BYTES
    assert BlockLayout(3, 1000, 3).slot_stride == 3 * PAGE_BYTES  # 9,000 bytes


@pytest.mark.parametrize("layers,size,tp", [(1, 1, 1), (4, 96, 3), (7, 4100, 2)])
def test_offsets_tile_the_block(layers, size, tp):
    layout = BlockLayout(layers, size, tp)
    starts = sorted(layout.offset(r, layer) for r in range(tp) for layer in range(layers))
    assert starts == [i * size for i in range(tp * layers)]
    # Each rank's shard is contiguous and layer-major.
    assert layout.offset(1 % tp, 0) == (1 % tp) * layout.shard_bytes
    assert layout.offset(0, layers - 1) == (layers - 1) * size
    assert layout.block_bytes <= layout.slot_stride < layout.block_bytes + PAGE_BYTES


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "layer_block_bytes": 1},
        {"num_layers": 1, "layer_block_bytes": -4},
        {"num_layers": 1, "layer_block_bytes": 4, "tp_size": 0},
        {"num_layers": 1.0, "layer_block_bytes": 4},
        {"num_layers": True, "layer_block_bytes": 4},
        {"num_layers": "2", "layer_block_bytes": 4},
    ],
)
def test_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="positive int"):
        BlockLayout(**kwargs)


def test_offset_range_checks_and_frozen():
    layout = BlockLayout(2, 64, 2)
    for rank, layer in [(-1, 0), (2, 0), (0, -1), (0, 2)]:
        with pytest.raises(ValueError, match="out of range"):
            layout.offset(rank, layer)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.num_layers = 3  # type: ignore[misc]


def test_for_tensors():
    torch = pytest.importorskip("torch")
    layers = [torch.zeros(10, 16, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    assert BlockLayout.for_tensors(layers, tp_size=4) == BlockLayout(3, 16 * 2 * 8 * 2, 4)
    assert BlockLayout.for_tensors([torch.zeros(5)]).layer_block_bytes == 4
    with pytest.raises(ValueError, match="empty"):
        BlockLayout.for_tensors([])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockLayout.for_tensors([torch.zeros(0, 4)])


def test_shm_modules_import_without_torch():
    code = (
        "import sys, shm.layout, shm.pool, shm.copy; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
