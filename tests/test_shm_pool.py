"""ShmPool over real shared memory: create, attach from another process,
slot addressing, cleanup, and errors that change nothing; POSIX shm pools,
and directory pools on tmpfs, a huge=always tmpfs and hugetlbfs (the huge
ones mounted for the test, skipped where that needs root or pages it lacks)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
from shm_helpers import checked_prefix, shm_entries

from bench.hugepages import HugePagesUnavailable, hugetlbfs, thp_tmpfs
from shm.pages import PAGE_KINDS
from shm.pool import SHM_DIR, ShmPool, ShmPoolError, id_bounds, remove_stale_segments

PAGE = 4096
HUGE = 2 << 20
SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


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


def share_with_child(pool: ShmPool, stride: int) -> str:
    """Slot 1 filled here is read by another process that attaches by the
    pool's names and fills slot 2; returns the child's page kind."""
    data = np.random.default_rng(1).integers(0, 256, stride, dtype=np.uint8)
    pool.slot_view(1, stride)[:] = data
    child = (
        "import hashlib, json, sys\n"
        "from shm.pool import ShmPool\n"
        "names, sizes, stride = json.loads(sys.argv[1])\n"
        "with ShmPool.attach(names, sizes) as pool:\n"
        "    assert not pool.owner\n"
        "    print(hashlib.sha256(pool.slot_view(1, stride).tobytes()).hexdigest())\n"
        "    print(pool.page_kind)\n"
        "    pool.slot_view(2, stride)[:] = 7\n"
    )
    args = json.dumps([list(pool.segment_names), list(pool.segment_sizes), stride])
    done = subprocess.run([sys.executable, "-c", child, args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    digest, kind = done.stdout.split()
    assert digest == hashlib.sha256(data.tobytes()).hexdigest()
    assert (pool.slot_view(2, stride) == 7).all()
    return kind


def test_another_process_sees_and_writes_the_same_bytes(pool):
    assert share_with_child(pool, 2 * PAGE) == pool.page_kind
    assert shm_entries(pool.segment_names[0][1:]) != []  # the attacher did not unlink
    assert pool.directory is None and pool.page_kind in PAGE_KINDS


def test_attach_errors(pool, prefix):
    names, sizes = pool.segment_names, pool.segment_sizes
    with pytest.raises(ShmPoolError, match="does not exist"):
        ShmPool.attach([f"/{prefix}.9"], [PAGE])
    with pytest.raises(ShmPoolError, match="is 8192 bytes, not 12288"):
        ShmPool.attach(names, [sizes[0], sizes[1], 3 * PAGE])
    with pytest.raises(ValueError, match="one size per segment"):
        ShmPool.attach(names, sizes[:1])
    for bad in ["no-slash", "/", "/.x", "//a", "/a/../b", "/a//b", "/a/.x", "/a/b/", "a/b"]:
        with pytest.raises(ValueError, match="bad shm segment name"):
            ShmPool.attach([bad], [PAGE])
    with pytest.raises(ShmPoolError, match="does not exist"):  # a path: a directory pool
        ShmPool.attach([f"/dev/shm/{prefix}-nowhere/x.0"], [PAGE])
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
            order = np.arange(expect)[::-1]  # slot_views: the same regions, in the order asked
            many = pool.slot_views(order, stride)
            for slot, mv in zip(order.tolist(), many, strict=True):
                array = np.frombuffer(mv, dtype=np.uint8)
                assert array.ctypes.data == starts[slot] and mv.nbytes == stride
                assert not mv.readonly and (array == slot + 1).all()
                mv.release()
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
    with pytest.raises(ValueError):
        pool.slot_views(np.asarray(slots), 2 * PAGE)
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


# ---- directory pools ------------------------------------------------------------------


def no_shmem_thp() -> bool:
    """Whether plain tmpfs (no huge= option) gets no transparent huge pages here."""
    with contextlib.suppress(OSError):
        return any(f"[{v}]" in SHMEM_THP.read_text() for v in ("never", "deny"))
    return True


@pytest.fixture
def mem_dir():
    """A fresh directory on /dev/shm (tmpfs, 4 KiB pages); must be left empty."""
    path = tempfile.mkdtemp(prefix="kvtest-pooldir-", dir=SHM_DIR)
    yield path
    left = os.listdir(path)
    shutil.rmtree(path)
    assert not left, f"files left behind: {left}"


@contextlib.contextmanager
def huge_mount(kind: str):
    """A huge-page mount of 8 MiB made for one test; skips where it cannot be had."""
    mount = thp_tmpfs if kind == "thp" else hugetlbfs
    with contextlib.suppress(OSError):
        if kind == "thp" and "[deny]" in SHMEM_THP.read_text():
            pytest.skip("transparent huge pages for shmem are denied here")
    try:
        with mount(4 * HUGE) as path:
            yield path
            left = os.listdir(path)
            for name in left:
                os.unlink(os.path.join(path, name))
            assert not left, f"files left behind: {left}"
    except HugePagesUnavailable as err:
        pytest.skip(f"no {kind} mount here: {err}")


@pytest.fixture(params=["thp", "hugetlbfs"])
def huge_dir(request):
    """(kind, path) of a huge-page mount."""
    with huge_mount(request.param) as path:
        yield request.param, path


@pytest.fixture
def hugetlb_dir():
    with huge_mount("hugetlbfs") as path:
        yield path


def test_directory_pool_names_sizes_mode_and_cleanup(mem_dir, prefix):
    with ShmPool.create(prefix, 3 * HUGE + 1, directory=mem_dir, segment_bytes=2 * HUGE) as pool:
        assert pool.segment_names == tuple(f"{mem_dir}/{prefix}.{i}" for i in range(2))
        assert pool.segment_sizes == (2 * HUGE, 2 * HUGE)  # whole huge pages
        assert pool.directory == mem_dir and pool.owner
        for name, size in zip(pool.segment_names, pool.segment_sizes, strict=True):
            st = os.stat(name)
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == size
        assert pool.page_kind == "4k" or not no_shmem_thp()
        assert share_with_child(pool, 2 * PAGE) == pool.page_kind
        assert len(os.listdir(mem_dir)) == 2  # the attacher did not unlink
    assert os.listdir(mem_dir) == []
    assert shm_entries(prefix) == []  # nothing in /dev/shm itself


@pytest.mark.parametrize("bad", ["relative/dir", "/", "//x", "/a/../b", "/a/", "", 3])
def test_bad_directory_is_refused(bad, prefix):
    with pytest.raises(ValueError, match="bad pool directory"):
        ShmPool.create(prefix, PAGE, directory=bad)
    with pytest.raises(ValueError, match="bad pool directory"):
        remove_stale_segments(prefix, bad)


def test_unusable_directory_creates_nothing(mem_dir, prefix, tmp_path):
    with pytest.raises(ShmPoolError, match="does not exist"):
        ShmPool.create(prefix, PAGE, directory=f"{mem_dir}/missing")
    with pytest.raises(ShmPoolError, match="not on tmpfs or hugetlbfs"):
        ShmPool.create(prefix, PAGE, directory=str(tmp_path))  # a disk filesystem
    with pytest.raises(ValueError, match="multiple of 2097152"):
        ShmPool.create(prefix, PAGE, directory=mem_dir, segment_bytes=PAGE)
    with pytest.raises(ShmPoolError, match="bytes free"):
        ShmPool.create(prefix, os.statvfs(mem_dir).f_blocks * PAGE + HUGE, directory=mem_dir)
    assert os.listdir(tmp_path) == [] and os.listdir(mem_dir) == []


def test_existing_file_is_refused_and_partial_create_is_undone(mem_dir, prefix):
    foreign = Path(mem_dir) / f"{prefix}.1"
    foreign.write_bytes(b"x")
    with pytest.raises(ShmPoolError, match="already exists"):
        ShmPool.create(prefix, 3 * HUGE, directory=mem_dir, segment_bytes=HUGE)
    assert os.listdir(mem_dir) == [foreign.name] and foreign.read_bytes() == b"x"
    foreign.unlink()


def test_attach_refuses_links_other_filesystems_and_wrong_sizes(mem_dir, prefix, tmp_path):
    with ShmPool.create(prefix, HUGE, directory=mem_dir) as pool:
        (name,), (size,) = pool.segment_names, pool.segment_sizes
        link = f"{mem_dir}/{prefix}.link"
        os.symlink(name, link)
        try:
            with pytest.raises(ShmPoolError, match="symbolic link"):
                ShmPool.attach([link], [size])
        finally:
            os.unlink(link)
        on_disk = tmp_path / "x.0"
        on_disk.write_bytes(b"\0" * PAGE)
        with pytest.raises(ShmPoolError, match="not a file on tmpfs or hugetlbfs"):
            ShmPool.attach([str(on_disk)], [PAGE])
        with pytest.raises(ShmPoolError, match=f"is {size} bytes, not {size + PAGE}"):
            ShmPool.attach([name], [size + PAGE])
        with ShmPool.attach([name], [size]) as attached:
            assert attached.directory == mem_dir and not attached.owner


def test_remove_stale_segments_in_a_directory_removes_only_its_names(mem_dir, prefix):
    stale = ShmPool.create(prefix, 3 * HUGE, directory=mem_dir, segment_bytes=HUGE)
    stale.close()  # a dead sidecar: closed, never unlinked
    neighbours = [f"{prefix}x.0", f"{prefix}.x.0", f"{prefix}.0a", prefix]
    for name in neighbours:
        (Path(mem_dir) / name).write_bytes(b"")
    posix = ShmPool.create(prefix, PAGE, prefault=False)  # same prefix, POSIX shm
    try:
        removed = remove_stale_segments(prefix, mem_dir)
        assert removed == [f"{mem_dir}/{prefix}.{i}" for i in range(3)]
        assert sorted(os.listdir(mem_dir)) == sorted(neighbours)
        assert remove_stale_segments(prefix, mem_dir) == []
        assert shm_entries(prefix) == [f"{prefix}.0"]  # the POSIX one is not touched
    finally:
        posix.close()
        posix.unlink()
        for name in neighbours:
            os.unlink(Path(mem_dir) / name)


def test_huge_page_pool(huge_dir, prefix):
    kind, path = huge_dir
    with ShmPool.create(prefix, 2 * HUGE + 1, directory=path, segment_bytes=2 * HUGE) as pool:
        assert pool.segment_sizes == (2 * HUGE, HUGE)
        assert pool.page_kind == kind
        if kind == "hugetlbfs":
            assert pool.pages.huge_bytes == pool.nbytes
        else:  # the kernel falls back to 4 KiB pages when it has no free huge one
            assert 0 < pool.pages.huge_bytes <= pool.nbytes
        assert share_with_child(pool, 2 * PAGE) == kind
        assert not pool.segment_view(1)[PAGE:].any()
    assert os.listdir(path) == []


def test_hugetlbfs_pool_beyond_the_reserved_pages_creates_nothing(hugetlb_dir, prefix):
    path = hugetlb_dir
    with ShmPool.create(prefix, 3 * HUGE, directory=path, segment_bytes=HUGE):
        with pytest.raises(ShmPoolError, match="huge pages"):
            ShmPool.create(prefix + "b", 2 * HUGE, directory=path)
        assert len(os.listdir(path)) == 3


def test_populate_maps_every_page_writable_and_keeps_the_bytes(prefix):
    with ShmPool.create(prefix, 256 * PAGE) as created:
        created.segment_view(0)[::PAGE] = 5
        for populate in (False, True):
            with ShmPool.attach(created.segment_names, created.segment_sizes) as pool:
                seconds = pool.populate() if populate else 0.0
                view = pool.segment_view(0)
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                view[::PAGE] += 1  # reads then writes every page
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
                assert (faults < 16) == populate and seconds >= 0
                del view
        assert (created.segment_view(0)[::PAGE] == 7).all()
    with pytest.raises(ShmPoolError, match="closed"):
        created.populate()


@pytest.mark.parametrize("n", [1, 2, 16, 17, 2048])
def test_id_bounds_is_min_and_max_at_every_size(n):
    rng = np.random.default_rng(n)
    for dtype in (np.int64, np.int32, np.uint64):
        ids = rng.integers(0 if dtype is np.uint64 else -5, 1000, n).astype(dtype)
        assert id_bounds(ids) == (int(ids.min()), int(ids.max()))
        assert all(type(v) is int for v in id_bounds(ids))
