"""The SSD tier's slot count across restarts: kept in each directory's header,
so a plain restart on a filesystem short of space keeps every block, and a
deliberate resize keeps the blocks that fit."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sidecar_proc import mounted_tmpfs

from sidecar.tiers.ssd.store import SsdStore

SLOT = 64 << 10


def block(seed: int) -> memoryview:
    buf = memoryview(mmap.mmap(-1, SLOT))  # page-aligned, as shm slots are
    buf[:] = np.random.default_rng(seed).integers(0, 256, SLOT, dtype=np.uint8).tobytes()
    return buf


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "little")


def fill(s: SsdStore) -> None:
    for slot in range(s.num_slots):
        s.write(slot, block(slot), key(slot), key(slot - 1), slot == 0)


def kept(s: SsdStore) -> list[int]:
    """Slots whose block is recorded and reads back byte-exact."""
    out = []
    for r in s.records():
        buf = memoryview(mmap.mmap(-1, SLOT))
        assert s.read(r.slot, buf, key(r.slot))
        assert bytes(buf) == bytes(block(r.slot))
        out.append(r.slot)
    return sorted(out)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: room for ~121 slots of 64 KiB (the 5% margin kept of the
    free space is several slots, so the old slot count grew at each restart)."""
    with mounted_tmpfs(tmp_path / "small", "size=8m") as mnt:
        yield mnt


def test_a_restart_short_of_space_keeps_the_slot_count_and_every_block(small_fs):
    asked = 256 * SLOT  # more than the filesystem holds
    s = SsdStore([str(small_fs / "ssd")], asked, SLOT, SLOT, "t")
    n = s.num_slots
    assert 0 < n < 256
    fill(s)
    s.close()
    for _ in range(2):  # each restart sees our files and the space left beside them
        s = SsdStore([str(small_fs / "ssd")], asked, SLOT, SLOT, "t")
        assert s.num_slots == n
        assert kept(s) == list(range(n))
        s.close()


def test_a_smaller_capacity_keeps_the_blocks_that_fit(small_fs):
    s = SsdStore([str(small_fs / "ssd")], 256 * SLOT, SLOT, SLOT, "t")
    assert s.num_slots > 4
    fill(s)
    s.close()
    s = SsdStore([str(small_fs / "ssd")], 4 * SLOT, SLOT, SLOT, "t")
    assert s.num_slots == 4
    assert kept(s) == [0, 1, 2, 3]
    s.close()
    assert os.path.getsize(small_fs / "ssd" / "t.data") == 4 * SLOT
    s = SsdStore([str(small_fs / "ssd")], 4 * SLOT, SLOT, SLOT, "t")  # and it stays so
    assert kept(s) == [0, 1, 2, 3]
    s.close()


def test_resizes_over_striped_directories(tmp_path):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    s = SsdStore(dirs, 4 * SLOT, SLOT, SLOT, "t")
    assert s.num_slots == 8
    fill(s)
    s.close()
    s = SsdStore(dirs, 2 * SLOT, SLOT, SLOT, "t")  # 2 per directory: slots 0-3
    assert s.num_slots == 4
    assert kept(s) == [0, 1, 2, 3]
    s.close()
    s = SsdStore(dirs, 6 * SLOT, SLOT, SLOT, "t")  # growing keeps them all
    assert s.num_slots == 12
    assert kept(s) == [0, 1, 2, 3]
    s.close()


def test_a_restart_of_the_shared_tier_short_of_space_keeps_its_extents_and_blocks(small_fs):
    """Asked for more than the filesystem holds, the shared tier sizes its
    extents by the room, which counts our own files: it grows as blocks are
    written. A restart must keep the extent size the files were laid out in
    (derived again, it would differ, and every block would be removed)."""
    from contract.ids import KEY_DTYPE, BlockKeys
    from shm.layout import BlockLayout
    from sidecar.config import Config
    from sidecar.tiers.ssd.space import SsdSpace

    config = Config(instance="x", ssd_dirs=[str(small_fs / "ssd")], ssd_capacity_per_dir="64MiB")
    layout = BlockLayout(2, SLOT // 2)
    space = SsdSpace(config)
    extent = space.extent_bytes
    assert space.num_extents == 1 and extent < 8 << 20  # the room, not 64 MiB
    tier = space.tier(layout)
    assert tier is not None
    engine, store = tier
    slots = engine.allocate(8)
    assert slots is not None and len(slots) == 8
    for i, slot in enumerate(slots.tolist()):
        store.write(slot, block(i), key(i), key(i - 1), i == 0)
    keys = np.frombuffer(b"".join(key(i) for i in range(8)), dtype=KEY_DTYPE)
    engine.insert(BlockKeys(keys), slots, ready=True)
    space.close()
    for _ in range(2):  # each restart sees more of our own files as room
        space = SsdSpace(config)
        assert space.extent_bytes == extent
        tier = space.tier(layout)
        assert tier is not None
        assert tier[0].index.num_blocks == 8
        for i, slot in enumerate(slots.tolist()):
            buf = memoryview(mmap.mmap(-1, SLOT))
            assert tier[1].read(slot, buf, key(i))
            assert bytes(buf) == bytes(block(i))
        space.close()


def test_another_instance_whose_name_starts_with_this_ones_is_not_counted_as_room(small_fs):
    """Instance "x" counts its own files as room (it may reuse their disk),
    not those of instance "x-2" beside it."""
    from shm.layout import BlockLayout
    from sidecar.config import Config
    from sidecar.tiers.ssd.space import SsdSpace

    def space(instance: str) -> SsdSpace:
        ssd = str(small_fs / "ssd")
        return SsdSpace(Config(instance=instance, ssd_dirs=[ssd], ssd_capacity_per_dir="64MiB"))

    other = space("x-2")
    tier = other.tier(BlockLayout(2, SLOT // 2))
    assert tier is not None and tier[0].allocate(1) is not None  # its one extent reserved
    mine = space("x")
    assert mine.num_extents * mine.extent_bytes < other.extent_bytes // 2
    mine.close()
    other.close()


def test_another_slot_size_still_starts_empty(tmp_path):
    s = SsdStore([str(tmp_path)], 4 * SLOT, SLOT, SLOT, "t")
    fill(s)
    s.close()
    s = SsdStore([str(tmp_path)], 8 * SLOT, 2 * SLOT, SLOT, "t")
    assert s.records() == []
    s.close()
