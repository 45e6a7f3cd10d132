"""ShmPool over real POSIX shared memory: create, attach from another process,
slot addressing, cleanup, and errors that change nothing."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest
from shm_helpers import checked_prefix, shm_entries

from shm.pool import SHM_DIR, ShmPool, ShmPoolError, remove_stale_segments

PAGE = 4096


@pytest.fixture
def prefix():
    with checked_prefix("pool") as name:
        yield name


@pytest.fixture
def pool(prefix):
    with ShmPool.create(prefix, 10 * PAGE, segment_bytes=4 * PAGE) as created:
        yield created


def test_create_sizes_names_and_mode(prefix):
    with ShmPool.create(prefix, 9 * PAGE + 1, segment_bytes=4 * PAGE) as pool:
        assert pool.segment_names == tuple(f"/{prefix}.{i}" for i in range(3))
        assert pool.segment_sizes == (4 * PAGE, 4 * PAGE, 2 * PAGE)  # rounded up to pages
        assert pool.nbytes == 10 * PAGE and pool.owner
        assert pool.prefault_seconds > 0 and pool.prefault_method.startswith("fallocate")
        for name, size in zip(pool.segment_names, pool.segment_sizes, strict=True):
            st = os.stat(SHM_DIR / name[1:])
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == size
        assert not pool.segment_view(0).any()  # fresh pages are zero
    assert shm_entries(prefix) == []  # leaving the with block unlinks a created pool


def test_create_without_prefault(prefix):
    with ShmPool.create(prefix, PAGE, prefault=False) as pool:
        assert pool.prefault_seconds == 0.0 and pool.prefault_method == "none"
        pool.slot_view(0, PAGE)[:] = 5
        assert pool.segment_view(0).sum() == 5 * PAGE


def test_another_process_sees_and_writes_the_same_bytes(pool):
    stride = 2 * PAGE
    data = np.random.default_rng(1).integers(0, 256, stride, dtype=np.uint8)
    pool.slot_view(1, stride)[:] = data
    child = (
        "import hashlib, json, sys\n"
        "from shm.pool import ShmPool\n"
        "names, sizes, stride = json.loads(sys.argv[1])\n"
        "with ShmPool.attach(names, sizes) as pool:\n"
        "    assert not pool.owner\n"
        "    print(hashlib.sha256(pool.slot_view(1, stride).tobytes()).hexdigest())\n"
        "    pool.slot_view(2, stride)[:] = 7\n"
    )
    args = json.dumps([list(pool.segment_names), list(pool.segment_sizes), stride])
    done = subprocess.run([sys.executable, "-c", child, args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hashlib.sha256(data.tobytes()).hexdigest()
    assert (pool.slot_view(2, stride) == 7).all()
    assert shm_entries(pool.segment_names[0][1:]) != []  # the attacher did not unlink


def test_attach_errors(pool, prefix):
    names, sizes = pool.segment_names, pool.segment_sizes
    with pytest.raises(ShmPoolError, match="does not exist"):
        ShmPool.attach([f"/{prefix}.9"], [PAGE])
    with pytest.raises(ShmPoolError, match="is 8192 bytes, not 12288"):
        ShmPool.attach(names, [sizes[0], sizes[1], 3 * PAGE])
    with pytest.raises(ValueError, match="one size per segment"):
        ShmPool.attach(names, sizes[:1])
    for bad in ["no-slash", "/a/b", "/", "/.x"]:
        with pytest.raises(ValueError, match="bad shm segment name"):
            ShmPool.attach([bad], [PAGE])
    attached = ShmPool.attach(names, sizes)  # the failures above left nothing mapped
    attached.close()


def test_slots_never_straddle_segments(prefix):
    sizes = (3 * PAGE, 3 * PAGE, 2 * PAGE)
    with ShmPool.create(prefix, sum(sizes), segment_bytes=3 * PAGE) as pool:
        assert pool.segment_sizes == sizes
        views = [pool.segment_view(i) for i in range(3)]
        spans = [(v.ctypes.data, v.ctypes.data + v.size) for v in views]
        for stride, expect in [(PAGE, 8), (2 * PAGE, 3), (3 * PAGE, 2), (4 * PAGE, 0)]:
            assert pool.num_slots(stride) == expect
            starts = pool.slot_addresses(np.arange(expect), stride)
            assert starts.dtype == np.uint64
            for start in starts.tolist():
                assert any(lo <= start and start + stride <= hi for lo, hi in spans)
            for slot in range(expect):  # each slot_view is the region at its address
                view = pool.slot_view(slot, stride)
                assert view.ctypes.data == starts[slot] and view.size == stride
                view[:] = slot + 1
            total = sum(int(v.astype(np.int64).sum()) for v in views)
            assert total == sum((s + 1) * stride for s in range(expect))
            for v in views:
                v[:] = 0


@pytest.mark.parametrize(
    "slots", [[5], [-1], [0, 99], [[0, 1]], [0.0], np.array([2**63], dtype=np.uint64)]
)
def test_bad_slots_raise_and_change_nothing(pool, slots):
    before = [pool.segment_view(i).copy() for i in range(3)]
    with pytest.raises(ValueError):
        pool.slot_addresses(np.asarray(slots), 2 * PAGE)  # 2 + 2 + 1 slots: 0..4
    assert pool.slot_addresses(np.array([], dtype=np.int64), 2 * PAGE).size == 0
    assert all(np.array_equal(pool.segment_view(i), before[i]) for i in range(3))


@pytest.mark.parametrize("stride", [0, -PAGE, 100, PAGE + 1, 1.5])
def test_bad_strides(pool, stride):
    with pytest.raises(ValueError, match="stride"):
        pool.num_slots(stride)
    with pytest.raises(ValueError, match="stride"):
        pool.slot_view(0, stride)


def test_existing_segment_is_refused_and_partial_create_is_undone(prefix):
    foreign = posix_ipc.SharedMemory(f"/{prefix}.1", posix_ipc.O_CREX, size=PAGE)
    foreign.close_fd()
    try:
        with pytest.raises(ShmPoolError, match="already exists"):
            ShmPool.create(prefix, 3 * PAGE, segment_bytes=PAGE)
        assert shm_entries(prefix) == [f"{prefix}.1"]  # ours unlinked, the foreign one kept
        assert os.stat(SHM_DIR / f"{prefix}.1").st_size == PAGE
    finally:
        foreign.unlink()


def test_too_large_for_dev_shm_creates_nothing(prefix):
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    with pytest.raises(ShmPoolError, match="free"):
        ShmPool.create(prefix, free + (1 << 30))
    assert shm_entries(prefix) == []


@pytest.mark.parametrize(
    "bad", ["", "/abc", "a/b", "a b", "../x", ".hidden", "-x", "x" * 201, "é", None, 3]
)
def test_bad_prefix_is_refused_and_creates_nothing(bad):
    with pytest.raises(ValueError, match="bad shm prefix"):
        ShmPool.create(bad, PAGE)
    with pytest.raises(ValueError, match="bad shm prefix"):
        remove_stale_segments(bad)
    if isinstance(bad, str) and bad and "/" not in bad:
        assert not (SHM_DIR / f"{bad}.0").exists()


@pytest.mark.parametrize("kwargs", [{"nbytes": 0}, {"nbytes": PAGE, "segment_bytes": 100}])
def test_bad_sizes(prefix, kwargs):
    with pytest.raises(ValueError):
        ShmPool.create(prefix, **kwargs)


def test_close_and_unlink_are_idempotent(prefix):
    pool = ShmPool.create(prefix, 2 * PAGE)
    view = pool.slot_view(1, PAGE)
    view[:] = 3
    pool.close()
    pool.close()
    assert pool.closed and (view == 3).all()  # a live view keeps its mapping
    with pytest.raises(ShmPoolError, match="closed"):
        pool.slot_addresses(np.array([0]), PAGE)
    with pytest.raises(ShmPoolError, match="closed"):
        pool.segment_view(0)
    assert shm_entries(prefix) == [f"{prefix}.0"]  # close does not unlink
    pool.unlink()
    pool.unlink()
    assert shm_entries(prefix) == []
    assert (view == 3).all()  # unlinking keeps existing mappings


def test_unlink_keeps_other_mappings_and_attach_does_not_unlink(prefix):
    created = ShmPool.create(prefix, PAGE)
    with ShmPool.attach(created.segment_names, created.segment_sizes) as attached:
        created.slot_view(0, PAGE)[:] = 9
        assert (attached.slot_view(0, PAGE) == 9).all()
    assert shm_entries(prefix) == [f"{prefix}.0"]
    created.unlink()
    created.slot_view(0, PAGE)[:] = 4  # still mapped
    created.close()
    assert repr(created) == "ShmPool(1 segments, 4,096 bytes, closed)"


def test_remove_stale_segments_removes_only_its_prefix(prefix):
    stale = ShmPool.create(prefix, 3 * PAGE, segment_bytes=PAGE, prefault=False)
    stale.close()  # a dead sidecar: closed, never unlinked
    neighbours = [f"/{prefix}x.0", f"/{prefix}.x.0", f"/{prefix}.0a", f"/{prefix}"]
    for name in neighbours:
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=PAGE).close_fd()
    try:
        removed = remove_stale_segments(prefix)
        assert removed == [f"/{prefix}.{i}" for i in range(3)]
        assert shm_entries(prefix) == sorted(n[1:] for n in neighbours)
        assert remove_stale_segments(prefix) == []
    finally:
        for name in neighbours:
            posix_ipc.unlink_shared_memory(name)
