"""sidecar.tiers.ssd.store (slots, journal, checksums) and sidecar.tiers.build.recover."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import xxhash
from helpers import chain, make_engine

from sidecar.tiers.ssd import store as store_module
from sidecar.tiers.ssd.space import recover
from sidecar.tiers.ssd.store import (
    NO_TAG,
    RECORD,
    Record,
    SsdError,
    SsdStore,
    WriteBlock,
    checksum,
)

SLOT = 8192


def aligned(n: int = SLOT) -> memoryview:
    return memoryview(mmap.mmap(-1, n))  # page-aligned, as shm slots are


def block(seed: int) -> memoryview:
    buf = aligned()
    buf[:] = np.random.default_rng(seed).integers(0, 256, SLOT, dtype=np.uint8).tobytes()
    return buf


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(tmp_path, dirs=2, capacity=4 * SLOT, tag="t") -> SsdStore:
    return SsdStore([str(tmp_path / f"d{i}") for i in range(dirs)], capacity, SLOT, SLOT, tag)


def test_blocks_round_trip_striped_over_directories(tmp_path):
    s = store(tmp_path)
    assert s.num_slots == 8
    for slot in range(8):
        s.write(slot, block(slot), key(slot + 1), key(slot), slot == 0)
    for slot in range(8):
        out = aligned()
        assert s.read(slot, out, key(slot + 1))
        assert bytes(out) == bytes(block(slot))
    sizes = [os.path.getsize(tmp_path / f"d{i}" / "t.data") for i in range(2)]
    assert sizes == [4 * SLOT, 4 * SLOT]
    s.close()


def choose_path(monkeypatch: pytest.MonkeyPatch, path: str, s: SsdStore) -> None:
    """Run `s`'s writes through Linux AIO (`path` "aio": skipped where there
    is none) or one `pwritev` after another, as without it."""
    if path == "one_by_one":
        monkeypatch.setattr(store_module._local, "queue", None, raising=False)
    elif not s.direct or store_module.aio_queue() is None:
        pytest.skip("no O_DIRECT here, or Linux AIO refused")


@pytest.mark.parametrize("path", ["aio", "one_by_one"])
def test_a_run_of_writes_reads_back_and_recovers(tmp_path, monkeypatch, path):
    s = store(tmp_path, capacity=64 * SLOT)
    choose_path(monkeypatch, path, s)
    order = [3, 0, 5, 1, 2, 4, 9]
    s.write_run([WriteBlock(i, block(i), key(i + 1), key(i), i == 0) for i in order])
    for i in order:
        out = aligned()
        assert s.read(i, out, key(i + 1)) and bytes(out) == bytes(block(i))
    if path == "aio":
        assert store_module.aio_queue().pending == 0
    s.close()
    again = store(tmp_path, capacity=64 * SLOT)
    got = sorted((r.slot, r.key, r.parent, r.first) for r in again.records())
    assert got == [(i, key(i + 1), key(i), i == 0) for i in sorted(order)]
    again.close()


@pytest.mark.parametrize("path", ["aio", "one_by_one"])
def test_a_failed_write_leaves_no_record_vouching_for_its_slot(tmp_path, monkeypatch, path):
    """A record goes invalid before its block's data is written: a write
    that fails (as one cut off by a crash) leaves no record for that slot,
    and every record left still reads back as its own block."""
    s = store(tmp_path, dirs=1, capacity=8 * SLOT)
    if not s.direct:
        pytest.skip("no O_DIRECT here: an unaligned buffer does not fail")
    choose_path(monkeypatch, path, s)
    s.write_run([WriteBlock(i, block(i), key(i + 1), key(i), i == 0) for i in range(3)])
    # O_DIRECT from a buffer off alignment: the device refuses it (EINVAL).
    off = memoryview(mmap.mmap(-1, 2 * SLOT))[1 : SLOT + 1]
    off[:] = bytes(block(11))
    with pytest.raises(OSError) as err:
        s.write_run(
            [
                WriteBlock(1, off, key(21), key(0), False),
                WriteBlock(2, block(12), key(22), key(21), False),
            ]
        )
    assert err.value.errno == errno.EINVAL
    if path == "aio":
        assert store_module.aio_queue().pending == 0
    s.close()
    again = store(tmp_path, dirs=1, capacity=8 * SLOT)
    records = again.records()
    assert 1 not in [r.slot for r in records] and 0 in [r.slot for r in records]
    for r in records:
        out = aligned()
        assert again.read(r.slot, out, r.key), f"slot {r.slot}'s record vouches for other bytes"
    again.close()


SHORT_WRITE = """
import mmap, os, resource, signal, sys
from sidecar.tiers.ssd import store as m
d, path, slot = sys.argv[1], sys.argv[2], 64 << 10
s = m.SsdStore([d], 4 * slot, slot, slot, "t")
if path == "one_by_one":
    m._local.queue = None
elif not s.direct or m.aio_queue() is None:
    print("skip")
    sys.exit(0)
block = memoryview(mmap.mmap(-1, slot))
block[:] = b"x" * slot
s.write(0, block, (1).to_bytes(16, "little"), bytes(16), True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2 * slot + slot // 2, resource.RLIM_INFINITY))
try:
    s.write(2, block, (3).to_bytes(16, "little"), bytes(16), False)
except OSError as err:
    print("error", err.errno)
pending = 0 if path == "one_by_one" else m.aio_queue().pending
print("pending", pending, "records", [r.slot for r in s.records()])
"""


@pytest.mark.parametrize("path", ["aio", "one_by_one"])
def test_a_write_cut_short_is_finished_where_it_stopped_or_fails_cleanly(tmp_path, path):
    """A file size limit halfway through slot 2 cuts its write short (the
    kernel takes half); the rest, tried from where it stopped, fails: the
    write raises, nothing is left in flight, slot 2 has no valid record,
    slot 0 keeps its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", SHORT_WRITE, str(tmp_path), path],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "skip":
        pytest.skip("no O_DIRECT here, or Linux AIO refused")
    assert done.stdout.split("\n")[:2] == [f"error {errno.EFBIG}", "pending 0 records [0]"]


def test_a_block_of_the_wrong_size_is_refused_before_anything_is_written(tmp_path):
    s = store(tmp_path, dirs=1)
    s.write(0, block(0), key(1), key(0), True)
    short = aligned()[: SLOT // 2]
    with pytest.raises(ValueError, match="a block of 4096 bytes for slots of 8192"):
        s.write_run(
            [
                WriteBlock(1, block(1), key(2), key(1), False),
                WriteBlock(0, short, key(9), key(0), True),
            ]
        )
    with pytest.raises(ValueError, match="out of range"):
        s.write_run(
            [
                WriteBlock(0, block(5), key(9), key(0), True),
                WriteBlock(99, block(1), key(2), key(1), False),
            ]
        )
    assert [(r.slot, r.key) for r in s.records()] == [(0, key(1))]
    out = aligned()
    assert s.read(0, out, key(1)) and bytes(out) == bytes(block(0))
    s.close()


def test_a_flipped_byte_or_a_wrong_key_fails_the_read(tmp_path):
    s = store(tmp_path, dirs=1)
    s.write(1, block(1), key(7), key(6), False)
    with open(tmp_path / "d0" / "t.data", "r+b") as f:
        f.seek(SLOT + 100)
        b = f.read(1)
        f.seek(SLOT + 100)
        f.write(bytes([b[0] ^ 1]))
    assert not s.read(1, aligned(), key(7))
    s.write(2, block(2), key(8), key(7), False)
    assert not s.read(2, aligned(), key(9))
    assert s.read(2, aligned(), key(8))
    s.close()


def test_records_survive_a_reopen_and_drop_clears_one(tmp_path):
    s = store(tmp_path)
    s.write(0, block(0), key(1), key(0), True)
    s.write(3, block(3), key(2), key(1), False)
    s.drop(0)
    s.close()
    again = store(tmp_path)
    records = again.records()
    assert [(r.slot, r.key, r.parent, r.first) for r in records] == [(3, key(2), key(1), False)]
    out = aligned()
    assert again.read(3, out, key(2)) and bytes(out) == bytes(block(3))
    again.close()


def test_a_restart_on_a_filesystem_filled_since_keeps_its_blocks(tmp_path, monkeypatch):
    """The files already hold every slot: the free-space margin must not
    shrink the tier below them (which would start it empty, blocks lost)."""
    s = store(tmp_path, dirs=1, capacity=64 * SLOT)
    s.write(5, block(5), key(1), key(0), True)
    s.close()
    full = os.statvfs_result((4096, 4096, 1 << 20, 0, 0, 1000, 0, 0, 0, 255))  # 0 bytes free
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    again = store(tmp_path, dirs=1, capacity=64 * SLOT)
    assert again.num_slots == 64
    out = aligned()
    assert [r.slot for r in again.records()] == [5]
    assert again.read(5, out, key(1)) and bytes(out) == bytes(block(5))
    again.close()


def test_a_directory_written_with_another_slot_size_starts_empty(tmp_path):
    s = store(tmp_path)
    s.write(0, block(0), key(1), key(0), True)
    s.close()
    other = SsdStore([str(tmp_path / "d0"), str(tmp_path / "d1")], 8 * SLOT, 2 * SLOT, SLOT, "t")
    assert other.records() == []
    other.close()


def test_instance_names_share_a_directory_without_touching_each_other(tmp_path):
    a = store(tmp_path, tag="a")
    a.write(0, block(0), key(1), key(0), True)
    with pytest.raises(SsdError, match="in use by another sidecar"):
        store(tmp_path, tag="a")  # the same name twice: its files are locked
    b = store(tmp_path, tag="b")
    b.write(0, block(5), key(9), key(0), True)
    a.close()
    b.close()
    for tag, k, seed in (("a", 1, 0), ("b", 9, 5)):
        again = store(tmp_path, tag=tag)
        out = aligned()
        assert [r.key for r in again.records()] == [key(k)]
        assert again.read(0, out, key(k)) and bytes(out) == bytes(block(seed))
        again.close()
    assert {f.name for f in (tmp_path / "d0").iterdir()} == {
        f"{t}.{ext}" for t in "ab" for ext in ("data", "journal", "json")
    }


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError):
        SsdStore([str(tmp_path)], SLOT, 1000, 1000, "t")
    with pytest.raises(ValueError):
        SsdStore([], SLOT, SLOT, SLOT, "t")
    s = store(tmp_path)
    with pytest.raises(ValueError):
        s.read(99, aligned(), key(1))
    s.close()


def rec(slot: int, k: int, parent: int, first: bool = False) -> Record:
    return Record(slot, key(k), key(parent), first, 0)


def test_a_record_keeps_its_namespace_tag_and_write_time_and_old_records_read_as_none(
    tmp_path,
):
    s = store(tmp_path)
    tag = b"ns-tag-8"
    before = time.time_ns() // 1_000_000
    s.write(0, block(0), key(1), key(0), True, tag)
    s.write(3, block(3), key(2), key(1), False)
    after = time.time_ns() // 1_000_000
    s.close()
    again = store(tmp_path)
    first, second = sorted(again.records(), key=lambda r: r.slot)
    assert first.ns_tag == tag and before <= first.written_ms <= after
    assert second.ns_tag == NO_TAG and before <= second.written_ms <= after
    again.close()
    # A journal written before tags were recorded: its last 16 bytes are zero.
    (journal,) = (tmp_path / "d0").glob("*.journal")  # slot 0's: the first record
    with open(journal, "r+b") as f:
        raw = f.read(RECORD.size)
        f.seek(0)
        f.write(raw[:48] + bytes(16))
    old = store(tmp_path)
    first = min(old.records(), key=lambda r: r.slot)
    assert (first.slot, first.key, first.ns_tag, first.written_ms) == (0, key(1), NO_TAG, 0)
    old.close()


def test_recover_names_the_trees_whose_top_records_a_namespace():
    engine = make_engine("ssd", 16)
    keys = chain(3)
    raw = [keys[i].tobytes() for i in range(3)]
    other = chain(5)[4].tobytes()
    records = [
        Record(5, raw[0], b"\0" * 16, True, 0, b"tagged-1", 1_000),
        Record(6, raw[1], raw[0], False, 0, b"tagged-1", 2_000),
        Record(7, raw[2], raw[1], False, 0, b"tagged-1", 3_000),
        Record(9, other, b"\0" * 16, True, 0),  # written before tags: none
    ]
    trees: dict[bytes, dict[bytes, int]] = {}
    placed, orphans = recover(engine, records, trees)
    assert (placed, orphans) == (4, [])
    assert trees == {b"tagged-1": {raw[0]: 1_000}}  # as old as its top


def test_recover_rebuilds_chains_and_returns_orphans():
    engine = make_engine("ssd", 16)
    keys = chain(4)  # ids 1..4 as 16-byte keys
    raw = [keys[i].tobytes() for i in range(4)]
    records = [
        Record(5, raw[0], b"\0" * 16, True, 0),
        Record(6, raw[1], raw[0], False, 0),
        Record(7, raw[2], raw[1], False, 0),
        Record(9, raw[3], raw[2], False, 0),
        Record(8, raw[2], raw[1], False, 0),  # the same key again: dropped
        rec(10, 99, 98),  # parent unknown: an orphan
    ]
    placed, orphans = recover(engine, records)
    assert placed == 4 and sorted(orphans) == [8, 10]
    m = engine.match(keys)
    assert m.num_blocks == 4 and m.slots.tolist() == [5, 6, 7, 9]
    assert engine.mempool.num_used == 4


def test_checksum_is_xxh3_64_seeded_by_the_key():
    """The value stored on disk and in the remote tier: it must not change."""
    data = np.random.default_rng(3).integers(0, 256, 256 << 10, dtype=np.uint8)
    key = bytes(range(16))
    want = xxhash.xxh3_64_intdigest(data, seed=int.from_bytes(key[:8], "little"))
    assert checksum(data, key) == want
    assert checksum(data, bytes(16)) != want


def test_a_restart_with_other_extents_removes_the_files_laid_out_in_the_old_ones(tmp_path):
    from shm.layout import BlockLayout
    from sidecar.config import Config
    from sidecar.tiers.ssd.space import SsdSpace

    def space(extent: str) -> SsdSpace:
        return SsdSpace(
            Config(
                instance="x",
                ssd_dirs=[str(tmp_path)],
                ssd_capacity_per_dir="4MiB",
                ssd_extent_size=extent,
            )
        )

    layout = BlockLayout(2, SLOT // 2)
    first = space("1MiB")
    assert first.num_extents == 4 and first.tier(layout) is not None
    first.close()
    assert len(list(tmp_path.glob("kvsidecar-x-*"))) == 3  # data, journal, header
    reopened = space("1MiB")
    assert list(reopened.tiers) == [layout]  # found on disk before anyone asks
    reopened.close()
    other = space("2MiB")
    assert other.num_extents == 2 and not other.tiers
    assert not list(tmp_path.glob("kvsidecar-x-*"))
    other.close()


def test_every_tier_gets_every_eviction_setting(tmp_path):
    """The remote tier's index once went without `hit_reward_seconds`: with
    `lru` it ranked a block hit three times like one never hit."""
    from shm_helpers import checked_prefix

    from shm.layout import BlockLayout
    from shm.pool import ShmPool
    from sidecar.config import Config
    from sidecar.control.arena import ExtentArena
    from sidecar.tiers.build import open_tiered_cache

    config = Config(
        eviction_policy="lru",
        hit_reward_seconds=30.0,
        evict_start_threshold=0.5,
        evict_ratio=0.25,
        remote_url="redis://127.0.0.1:1/0",  # connected on first use: never here
    )
    layout = BlockLayout(num_layers=2, layer_block_bytes=4096)
    with checked_prefix("tiers") as prefix, ShmPool.create(prefix, 1 << 20) as pool:
        arena = ExtentArena(pool.segment_sizes, None)
        tiered = open_tiered_cache(config, pool, layout, lambda *_: None, arena, None)
        try:
            engines = [tiered.cache.cpu, *tiered.cache.lower.values()]
            assert [e.name for e in engines] == ["cpu", "remote"]
            for engine in engines:
                node = engine.index.root  # any node: the policy ranks its fields
                node.last_access, node.hit_count = 100.0, 3
                assert engine.index.policy._priority(node)[0] == 190.0, engine.name
                assert (engine.evict_start_threshold, engine.evict_ratio) == (0.5, 0.25)
        finally:
            tiered.close()
