"""libkvcopy.so: built by `pip install -e .` wherever nvcc is, loadable without a
GPU, and failing with GpuUnavailable (not a crash) where no GPU or driver is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_ext import _lib

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "cuda_ext" / "csrc" / "kvcopy.cu"


def nvcc_present() -> bool:
    """Where setup.py looks for nvcc."""
    homes = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")]
    return bool(shutil.which("nvcc") or any(h and Path(h, "bin", "nvcc").exists() for h in homes))


@pytest.mark.skipif(not nvcc_present(), reason="no nvcc: the library is not built here")
def test_the_library_is_built_wherever_nvcc_is():
    assert _lib.LIB_PATH.exists(), (
        f"nvcc is installed but {_lib.LIB_PATH} is missing: `pip install -v -e .` shows why"
    )
    assert _lib.LIB_PATH.stat().st_mtime >= SOURCE.stat().st_mtime, (
        f"{_lib.LIB_PATH.name} is older than {SOURCE.name}: rebuild with `pip install -e .`"
    )


PROBE = """
from cuda_ext import _lib
lib = _lib.load()
print("runtime", _lib.runtime_version(), "abi", lib.kv_abi_version())
try:
    print("gpus", _lib.probe())
except _lib.GpuUnavailable as exc:
    print("unavailable", exc)
"""


@pytest.mark.skipif(not _lib.LIB_PATH.exists(), reason="libkvcopy.so is not built")
def test_loading_without_a_gpu_gives_a_clear_error_not_a_crash():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first.startswith("runtime 13.") or first.startswith("runtime 12."), first
    assert first.endswith(f"abi {_lib.ABI_VERSION}")
    if second.startswith("unavailable"):
        assert "driver" in second and "staged path" in second, second
    else:
        assert int(second.split()[1]) >= 1


@pytest.mark.skipif(not _lib.LIB_PATH.exists(), reason="libkvcopy.so is not built")
def test_cuda_errors_map_to_the_two_exceptions():
    with pytest.raises(_lib.CudaError, match="cudaErrorInvalidValue") as info:
        _lib.check(1, "a call")
    assert info.value.code == 1 and info.value.name == "cudaErrorInvalidValue"
    with pytest.raises(_lib.GpuUnavailable, match="cudaErrorNoDevice"):
        _lib.check(100, "a call")
    _lib.check(0, "a call")


@pytest.mark.skipif(not _lib.LIB_PATH.exists(), reason="libkvcopy.so is not built")
def test_only_the_c_abi_is_exported():
    """cudart is linked statically and kept private: an engine's own
    libcudart never binds to ours, nor ours to it."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    out = subprocess.run(
        [nm, "-D", "--defined-only", str(_lib.LIB_PATH)], capture_output=True, text=True
    ).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["T"]}
    assert names == set(_lib._SIGNATURES), names ^ set(_lib._SIGNATURES)
    needed = subprocess.run(["ldd", str(_lib.LIB_PATH)], capture_output=True, text=True).stdout
    assert "libcudart" not in needed and "libcuda.so" not in needed, needed


def test_a_missing_library_is_gpu_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(_lib, "LIB_PATH", tmp_path / "libkvcopy.so")
    with pytest.raises(_lib.GpuUnavailable, match=r"not built.*nvcc"):
        _lib.load.__wrapped__()


@pytest.mark.parametrize(
    ("abi", "message"), [(0, "its ABI is 0"), (_lib.ABI_VERSION, "undefined symbol")]
)
def test_a_stale_library_is_gpu_unavailable(monkeypatch, tmp_path, abi, message):
    # An older build: another ABI, or this ABI number without the newer symbols.
    source = tmp_path / "old.c"
    source.write_text(f"int kv_abi_version(void) {{ return {abi}; }}\n")
    lib = tmp_path / "libkvcopy.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", lib, source], check=True)
    monkeypatch.setattr(_lib, "LIB_PATH", lib)
    with pytest.raises(_lib.GpuUnavailable, match=f"is stale.*{message}"):
        _lib.load.__wrapped__()


def test_gpu_copier_refuses_cpu_planes_and_open_copier_picks_the_cpu_one():
    torch = pytest.importorskip("torch")
    from cuda_ext.copier import CpuBlockCopier, open_copier
    from cuda_ext.gpu import GpuBlockCopier
    from cuda_ext.layouts import kv_planes

    planes = kv_planes([torch.zeros(4, 64)], "block_major")
    with pytest.raises(ValueError, match="CUDA tensors"):
        GpuBlockCopier(planes, None)  # type: ignore[arg-type]
    assert isinstance(open_copier(planes, None), CpuBlockCopier)  # type: ignore[arg-type]


def stage(blocks, slots, num_blocks, seg_slots, bases, stride, shard, unique, seen):
    """kv_stage_index on numpy arrays: (code, out)."""
    import numpy as np

    blocks, slots = np.asarray(blocks, np.int64), np.asarray(slots, np.int64)
    seg_slots, bases = np.asarray(seg_slots, np.int64), np.asarray(bases, np.uint64)
    out = np.full(2 * blocks.size, -1, np.int64)
    code = _lib.load().kv_stage_index(
        blocks.ctypes.data,
        slots.ctypes.data,
        blocks.size,
        num_blocks,
        seg_slots.ctypes.data,
        bases.ctypes.data,
        seg_slots.size,
        stride,
        shard,
        unique,
        seen.ctypes.data,
        out.ctypes.data,
    )
    return code, out


@pytest.mark.skipif(not _lib.LIB_PATH.exists(), reason="libkvcopy.so is not built")
def test_the_index_staging_matches_the_pool_and_refuses_what_check_request_refuses():
    """kv_stage_index (host code: no GPU needed) writes the block ids and the
    same slot addresses as ShmPool.slot_locations, across segments, and
    refuses out-of-range ids and repeats, leaving its bitmap zeroed."""
    import numpy as np

    stride, shard, seg_slots = 3 * 4096, 4096, [5, 3, 7]
    bases = [1 << 40, 2 << 40, 3 << 40]
    ends = np.cumsum(seg_slots)
    seen = np.zeros(8, np.uint8)  # 64 bits: >= 15 slots and 40 blocks
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 15))
        blocks, slots = rng.permutation(40)[:n], rng.permutation(15)[:n]
        code, out = stage(blocks, slots, 40, seg_slots, bases, stride, shard, 2, seen)
        segments = np.searchsorted(ends, slots, side="right")
        offsets = (slots - (ends - seg_slots)[segments]) * stride + shard
        want = (np.array(bases, np.uint64)[segments] + offsets.astype(np.uint64)).view(np.int64)
        assert code == 0
        assert np.array_equal(out[:n], blocks) and np.array_equal(out[n:], want)
        assert not seen.any()
    for blocks, slots, unique, code in [
        ([0, 40], [0, 1], 2, 1),  # block id out of range
        ([0, -1], [0, 1], 2, 1),
        ([0, 1], [0, 15], 2, 2),  # slot out of range
        ([0, 1], [-1, 1], 1, 2),
        ([0, 1, 2], [4, 9, 4], 2, 3),  # a save writing one slot twice
        ([7, 3, 7], [0, 1, 2], 1, 3),  # a load writing one block twice
    ]:
        assert stage(blocks, slots, 40, seg_slots, bases, stride, shard, unique, seen)[0] == code
        assert not seen.any()
    # Repeats of the ids that may repeat are fine: a load reads one slot twice.
    assert stage([1, 2], [4, 4], 40, seg_slots, bases, stride, shard, 1, seen)[0] == 0


@pytest.fixture(scope="module")
def staging_pool():
    """A 3-segment pool of 11 slots and CPU planes of 20 blocks, TP 2."""
    import torch
    from shm_helpers import checked_prefix

    from cuda_ext.layouts import kv_planes
    from shm.pool import ShmPool

    planes = kv_planes([torch.zeros(20, 2, 512) for _ in range(3)], "block_major")
    layout = planes.block_layout(2)
    stride = layout.slot_stride
    with (
        checked_prefix("stage") as prefix,
        ShmPool.create(prefix, 11 * stride, segment_bytes=4 * stride, prefault=False) as pool,
    ):
        assert [size // stride for size in pool.segment_sizes] == [4, 4, 3]
        yield planes, layout, pool


@pytest.mark.skipif(not _lib.LIB_PATH.exists(), reason="libkvcopy.so is not built")
def test_the_index_staging_agrees_with_check_request_on_any_ids(staging_pool):
    """For random ids, valid or not: kv_stage_index accepts exactly what
    check_request accepts, and then writes the addresses of its CopyRequest."""
    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from cuda_ext.copier import check_request

    planes, layout, pool = staging_pool
    stride = layout.slot_stride
    seg_slots = [size // stride for size in pool.segment_sizes]
    bases = np.array([1 << 40, 3 << 40, 5 << 40], np.uint64)
    seen = np.zeros(8, np.uint8)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        pairs=st.lists(st.tuples(st.integers(-2, 22), st.integers(-2, 13)), max_size=12),
        save=st.booleans(),
        rank=st.integers(0, 1),
    )
    def check(pairs, save, rank):
        blocks = np.array([b for b, _ in pairs], np.int64)
        slots = np.array([s for _, s in pairs], np.int64)
        try:
            request = check_request(planes, pool, blocks, slots, layout, rank, save=save)
        except ValueError:
            request = None
        shard = rank * layout.shard_bytes
        code, out = stage(
            blocks, slots, 20, seg_slots, bases, stride, shard, 2 if save else 1, seen
        )
        assert not seen.any()
        assert (code == 0) == (request is not None), (code, pairs, save)
        if request is not None:
            want = (bases[request.segments] + request.offsets.astype(np.uint64)).view(np.int64)
            assert np.array_equal(out[: blocks.size], blocks)
            assert np.array_equal(out[blocks.size :], want)

    check()


@pytest.mark.skipif(not _lib.LIB_PATH.exists(), reason="libkvcopy.so is not built")
def test_the_sm_path_refuses_block_strides_it_cannot_copy_before_touching_a_gpu():
    """kv_ops_create checks each plane's block stride (host code) before any
    CUDA call: a stride that is not a multiple of 16, or shorter than a
    chunk, is cudaErrorInvalidValue; good strides get as far as the device
    (no GPU here: an error of GpuUnavailable's kind, never a crash)."""
    import ctypes

    import numpy as np

    lib = _lib.load()

    def create(strides: list[int], chunk: int = 64) -> int:
        addrs = np.full(len(strides), 1 << 40, np.uint64)
        plane_strides = np.array(strides, np.uint64)
        bases = np.array([1 << 41], np.uint64)
        ops = ctypes.c_void_p(0)
        code = lib.kv_ops_create(
            0, None, addrs.ctypes.data, plane_strides.ctypes.data, len(strides), chunk, 8,
            bases.ctypes.data, 1, 8, 16, 4096, ctypes.byref(ops),
        )  # fmt: skip
        assert ops.value is None or code == 0
        if ops.value:
            lib.kv_ops_destroy(ops)
        return code

    invalid = 1  # cudaErrorInvalidValue
    assert create([64, 72]) == invalid  # not a multiple of 16
    assert create([64, 48]) == invalid  # shorter than a chunk
    code = create([64, 192, 4096])
    if code != 0:  # no usable GPU: the device guard refuses, after the checks
        assert code != invalid and _lib.error_name(code) in _lib.UNAVAILABLE_ERRORS
