"""The SSD tier through a real sidecar: staging, write policies, restart
recovery, checksums, a full filesystem, a disk that fails writes with EIO, a
vanished directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid

import numpy as np
import pytest
import torch
from sidecar_proc import MODEL, Sidecar, mounted_tmpfs, tmp_dir, tokens, wait_for

from contract import protocol as p
from engine_shim import KVClient, parts
from engine_shim.channel import Channel
from sidecar.metrics.prometheus import StatsCollector

# 128 KiB blocks: a 1 MiB CPU tier holds 8 of them.
SHAPE = (64, 2, 16, 8, 64)
BLOCK_TOKENS = 16
CPU = "1MiB"


def kv(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(2)]


def client(endpoint: str, cache: list[torch.Tensor]) -> KVClient:
    c = KVClient.connect(endpoint, timeout=5.0)
    c.register(cache, **{**MODEL, "num_kv_heads": 8, "head_dim": 64})
    return c


def ssd_stats(c: KVClient) -> dict:
    return c.stats()["tiers"]["ssd"]


def on_ssd(c: KVClient, n: int) -> bool:
    """n blocks on SSD and every write landed."""
    stats = c.stats()
    return stats["tiers"]["ssd"]["cached_blocks"] == n and stats["plans_in_flight"] == 0


class Instance:
    """One instance name and SSD directory, over several sidecar lives."""

    def __init__(
        self, ssd_dir: str, *extra: str, cpu: str = CPU, ssd_capacity: str = "8MiB"
    ) -> None:
        self.ssd_dir = ssd_dir
        self.extra = extra
        self.cpu, self.ssd_capacity = cpu, ssd_capacity
        self.name = f"s{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.runtime_dir = tmp_dir()
        self.sidecars: list[Sidecar] = []

    def start(self) -> Sidecar:
        s = Sidecar(
            "--set",
            f"ssd_dirs={self.ssd_dir}",
            "--set",
            f"ssd_capacity_per_dir={self.ssd_capacity}",
            *self.extra,
            capacity=self.cpu,
            instance=self.name,
            runtime_dir=self.runtime_dir,
        )
        self.sidecars.append(s)
        return s.start()

    def cleanup(self) -> None:
        for s in self.sidecars:
            s.cleanup()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture
def instance(tmp_path):
    inst = Instance(str(tmp_path / "ssd"))
    yield inst
    inst.cleanup()


@pytest.fixture
def write_back(tmp_path):
    inst = Instance(str(tmp_path / "ssd"), "--set", "write_policy=write_back")
    yield inst
    inst.cleanup()


@pytest.fixture
def write_back_lru(tmp_path):
    """`write_back` evicting least recently used first: a prefix loaded
    again and again still leaves the tier once enough is saved after it (a
    scan-resistant policy, such as the default's first candidate, keeps it)."""
    inst = Instance(
        str(tmp_path / "ssd"), "--set", "write_policy=write_back", "--set", "eviction_policy=lru"
    )
    yield inst
    inst.cleanup()


def fill_cpu(c: KVClient, n: int = 10) -> None:
    """Save n unrelated blocks, pushing older blocks out of the 8-block CPU tier."""
    for i in range(n):
        c.save(tokens(1, start=20_000 + 100 * i), np.arange(1)).wait()


def blocks_of(cache: list[torch.Tensor], ids: np.ndarray) -> list[bytes]:
    return [layer[torch.as_tensor(ids)].numpy().tobytes() for layer in cache]


def test_a_cpu_miss_loads_byte_exact_from_ssd(instance, asked):
    s = instance.start()
    src = kv(1)
    with client(s.endpoint, src) as c:
        assert c.save(tokens(5), np.arange(5)).wait() == 5 * BLOCK_TOKENS
        wait_for(lambda: on_ssd(c, 5))  # write_through lands on disk
        fill_cpu(c)
        stats = c.stats()
        assert stats["tiers"]["cpu"]["used_blocks"] <= 8
        dst = kv(None)
        with client(s.endpoint, dst) as other:
            assert other.lookup(tokens(5)) == 5 * BLOCK_TOKENS
            loaded = other.load(tokens(5), np.arange(10, 15)).wait()
            assert loaded == 5 * BLOCK_TOKENS
            assert blocks_of(dst, np.arange(10, 15)) == blocks_of(src, np.arange(5))
            assert other.stats()["hits"]["hit_blocks"]["ssd"] >= 1
    assert s.stop() == 0


def test_a_load_short_of_cpu_slots_is_answered_once_a_cancel_frees_them(instance):
    """A load that must stage SSD blocks while every CPU slot is held by another
    engine's open save waits; that engine cancelling its save frees the slots,
    and the load is answered then (not when some unrelated plan next ends)."""
    s = instance.start()
    src = kv(10)
    with client(s.endpoint, src) as c, client(s.endpoint, kv(11)) as w:
        assert c.save(tokens(4), np.arange(4)).wait() == 4 * BLOCK_TOKENS
        wait_for(lambda: on_ssd(c, 4))  # written: its CPU slots can be evicted
        fill_cpu(c)
        wait_for(lambda: c.stats()["plans_in_flight"] == 0)
        assert c.lookup_tiers(tokens(4)).cpu == 0
        channel = Channel(s.endpoint, 5.0)
        try:
            held = tokens(8, start=10_000)
            request = p.Save(v=1, id=0, session=w.session)
            arrays = [p.keys_frame(w.block_keys(held)), p.ids_frame(np.arange(8))]
            plan = channel.call(request, arrays)[0]
            assert plan.stored_blocks == 8  # every CPU slot, not ready, not evictable
            request = p.Load(v=1, id=0, session=c.session)
            rid = channel.send(
                request, [p.keys_frame(c.block_keys(tokens(4))), p.ids_frame(np.arange(20, 24))]
            )
            # Requests on one channel are handled in order: once Stats is
            # answered the load has been handled, and its reply (a reply
            # comes before the later Stats reply) has not come: it waits.
            channel.call(p.Stats(v=1, id=0))
            assert rid not in channel._early, "the load was answered before the cancel"
            channel.call(p.Cancel(v=1, id=0, session=w.session, plan_id=plan.plan_id))
            reply, _ = channel.wait_reply(rid, 3.0)
            assert reply.hit_blocks == 4
            channel.call(p.Cancel(v=1, id=0, session=c.session, plan_id=reply.plan_id))
        finally:
            channel.close()
        dst = kv(None)
        with client(s.endpoint, dst) as other:
            assert other.load(tokens(4), np.arange(30, 34)).wait() == 4 * BLOCK_TOKENS
            assert blocks_of(dst, np.arange(30, 34)) == blocks_of(src, np.arange(4))
        wait_for(lambda: c.stats()["plans_in_flight"] == 0)
    assert s.stop() == 0


def save_settled(c: KVClient, start: int) -> None:
    """Save one block, then wait for the write-backs it set off."""
    c.save(tokens(1, start=start), np.arange(1)).wait()
    wait_for(lambda: not c.stats()["plans_in_flight"])


def test_write_back_writes_to_ssd_only_on_eviction(write_back):
    s = write_back.start()
    src = kv(2)
    with client(s.endpoint, src) as c:
        c.save(tokens(3), np.arange(3)).wait()
        wait_for(lambda: not c.stats()["plans_in_flight"])  # a write-down it made landed
        assert ssd_stats(c)["cached_blocks"] == 0
        for i in range(10):
            save_settled(c, 20_000 + 100 * i)
        assert ssd_stats(c)["cached_blocks"] >= 3
        cpu = c.stats()["tiers"]["cpu"]
        assert cpu["used_blocks"] == cpu["cached_blocks"] == cpu["capacity_blocks"]
        dst = kv(None)
        with client(s.endpoint, dst) as other:
            # The CPU tier is full of blocks that have no SSD copy: staging
            # the load evicts some, whose write-backs hold their slots. The
            # load waits for those writes and delivers what lookup promised.
            assert other.lookup(tokens(3)) == 3 * BLOCK_TOKENS
            assert other.load(tokens(3), np.arange(20, 23)).wait() == 3 * BLOCK_TOKENS
            assert blocks_of(dst, np.arange(20, 23)) == blocks_of(src, np.arange(3))
    assert s.stop() == 0


def load_at_once(k: int, engine: KVClient, barrier: threading.Barrier, got: list) -> None:
    """Load 2 blocks of tokens(2) into engine blocks 0-1 once every loader is ready."""
    barrier.wait()
    got[k] = engine.load(tokens(2), np.arange(2)).wait()


def test_two_engines_loading_one_prefix_into_a_full_write_back_tier_both_get_it(write_back_lru):
    """Both stagings evict blocks whose write-backs hold the slots; the load
    that finds the other one staging its blocks waits for that staging, not
    for tries that unrelated write-backs use up."""
    s = write_back_lru.start()
    src = kv(3)
    with client(s.endpoint, src) as c:
        c.save(tokens(2), np.arange(2)).wait()
        dsts = [kv(None), kv(None)]
        with client(s.endpoint, dsts[0]) as a, client(s.endpoint, dsts[1]) as b:
            for r in range(8):
                for i in range(40):  # until the tier is full and the prefix only on SSD
                    save_settled(c, 20_000 + 1000 * r + 10 * i)
                    cpu = c.stats()["tiers"]["cpu"]
                    full = cpu["used_blocks"] == cpu["capacity_blocks"]
                    if full and a.lookup_tiers(tokens(2)).cpu == 0:
                        break
                else:
                    raise AssertionError("the CPU tier never filled up with the prefix out")
                assert a.lookup(tokens(2)) == b.lookup(tokens(2)) == 2 * BLOCK_TOKENS
                barrier = threading.Barrier(2)
                got: list[object] = [None, None]
                threads = [
                    threading.Thread(target=load_at_once, args=(k, e, barrier, got))
                    for k, e in enumerate((a, b))
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert got == [2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS], f"round {r}"
                for dst in dsts:
                    assert blocks_of(dst, np.arange(2)) == blocks_of(src, np.arange(2))
        wait_for(lambda: not c.stats()["plans_in_flight"])
    assert s.stop() == 0


def test_a_save_waiting_for_its_engine_copy_is_one_plan_in_flight(instance):
    s = instance.start()
    with client(s.endpoint, kv(2)) as c:
        channel = Channel(s.endpoint, 5.0)
        try:
            reply, _ = channel.call(  # a plan with the engine's D2H and the sidecar's H2DISK
                p.Save(v=p.PROTOCOL_VERSION, id=0, session=c.session),
                [p.keys_frame(c.block_keys(tokens(3))), p.ids_frame(np.arange(3))],
            )
            assert c.stats()["plans_in_flight"] == 1
            channel.call(p.Cancel(v=p.PROTOCOL_VERSION, id=0, session=c.session,
                                  plan_id=reply.plan_id))  # fmt: skip
            wait_for(lambda: c.stats()["plans_in_flight"] == 0)
        finally:
            channel.close()
    assert s.stop() == 0


def test_write_through_selective_counts_one_hit_per_engine_load(tmp_path):
    extra = ("--set", "write_policy=write_through_selective", "--set", "write_through_min_hits=2")
    inst = Instance(str(tmp_path / "ssd"), *extra)
    try:
        s = inst.start()
        with client(s.endpoint, kv(2)) as c:
            c.save(tokens(3), np.arange(3)).wait()
            assert c.load(tokens(3), np.arange(10, 13)).wait() == 3 * BLOCK_TOKENS
            # A write-down is planned with the load that sets it off and is
            # one of its plan's ops: with no plan in flight, it would have landed.
            wait_for(lambda: on_ssd(c, 0))
            assert ssd_stats(c)["cached_blocks"] == 0  # one load is one hit, not two
            assert c.load(tokens(3), np.arange(20, 23)).wait() == 3 * BLOCK_TOKENS
            wait_for(lambda: on_ssd(c, 3))  # the second hit writes them down
        assert s.stop() == 0
    finally:
        inst.cleanup()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_restarted_sidecar_serves_what_the_ssd_holds(instance, how, asked):
    s = instance.start()
    src = kv(3)
    with client(s.endpoint, src) as c:
        c.save(tokens(6), np.arange(6)).wait()
        wait_for(lambda: on_ssd(c, 6))
    if how == "sigterm":
        assert s.stop() == 0
    else:
        s.kill()
    s = instance.start()
    dst = kv(None)
    with client(s.endpoint, dst) as c:
        assert ssd_stats(c)["cached_blocks"] == 6
        assert c.load(tokens(6), np.arange(30, 36)).wait() == 6 * BLOCK_TOKENS
        assert blocks_of(dst, np.arange(30, 36)) == blocks_of(src, np.arange(6))
    assert s.stop() == 0


def saved_on_ssd_alone(instance: Instance, n: int, seed: int) -> tuple[Sidecar, list[torch.Tensor]]:
    """Blocks 0..n-1 of kv(seed) saved, on SSD, and the sidecar restarted:
    its CPU tier empty, the SSD's blocks recovered. (The sidecar, the KV.)"""
    s = instance.start()
    src = kv(seed)
    with client(s.endpoint, src) as c:
        c.save(tokens(n), np.arange(n)).wait()
        wait_for(lambda: on_ssd(c, n))
    assert s.stop() == 0
    return instance.start(), src


def test_a_load_in_parts_is_asked_and_answered_part_by_part(instance, monkeypatch):
    monkeypatch.setattr(parts, "PART_BYTES", 2 * 128 * 1024)  # 2 blocks a part
    s, src = saved_on_ssd_alone(instance, 7, seed=7)
    dst = kv(None)
    with client(s.endpoint, dst) as c:
        assert c.load(tokens(7), np.arange(30, 37)).wait() == 7 * BLOCK_TOKENS
        assert blocks_of(dst, np.arange(30, 37)) == blocks_of(src, np.arange(7))
        stats = c.stats()
        assert stats["transfers"]["loads"] == 4  # [0, 2) [2, 4) [4, 6) [6, 7)
        assert stats["transfers"]["loaded_blocks"] == 7
        assert stats["plans_in_flight"] == 0 and stats["tiers"]["cpu"]["used_blocks"] == 7
        # CPU hits now: served whole, from the hot index (one load, counted once told).
        assert c.load(tokens(7), np.arange(40, 47)).wait() == 7 * BLOCK_TOKENS
        assert c.stats()["transfers"]["loads"] == 5
        assert blocks_of(dst, np.arange(40, 47)) == blocks_of(src, np.arange(7))
    assert s.stop() == 0


def test_a_sidecar_not_naming_load_end_is_asked_for_whole_loads(instance, monkeypatch):
    """An engine updated before its host's sidecar: a sidecar whose register
    reply does not name `load_end` (one from before loads in parts, which
    refuses the field) is asked for one load, not for parts."""
    monkeypatch.setattr(parts, "PART_BYTES", 1)
    s, src = saved_on_ssd_alone(instance, 4, seed=9)
    dst = kv(None)
    with client(s.endpoint, dst) as c:
        assert p.LOAD_END in c._link.features  # this sidecar takes it
        monkeypatch.setattr(c._link, "features", frozenset())
        assert c.load(tokens(4), np.arange(30, 34)).wait() == 4 * BLOCK_TOKENS
        assert blocks_of(dst, np.arange(30, 34)) == blocks_of(src, np.arange(4))
        assert c.stats()["transfers"]["loads"] == 1
    assert s.stop() == 0


def test_a_part_answered_short_ends_the_load_and_the_parts_asked_after_it_are_given_up(
    instance, monkeypatch
):
    monkeypatch.setattr(parts, "PART_BYTES", 1)  # a block a part, two asked ahead
    s, src = saved_on_ssd_alone(instance, 3, seed=8)
    dst = kv(None)
    with client(s.endpoint, dst) as c:
        # Blocks 0-2 on SSD, 3-6 nowhere: part 4 comes back empty, part 5 was asked.
        assert c.load(tokens(7), np.arange(30, 37)).wait() == 3 * BLOCK_TOKENS
        assert blocks_of(dst, np.arange(30, 33)) == blocks_of(src, np.arange(3))
        assert c.stats()["transfers"]["loads"] == 5
        channel = c._link.channel
        wait_for(lambda: c.lookup(tokens(7)) >= 0 and not channel.late)  # part 5's reply read
        assert not channel._awaited and not channel._early
        assert c.stats()["plans_in_flight"] == 0
        assert c.delete(tokens(1)) == 6  # from both tiers: nothing of the load left locked
    assert s.stop() == 0


def test_a_sidecar_killed_while_writing_to_ssd_recovers_only_whole_blocks(tmp_path):
    """SIGKILL right after a 48-block save returns, its write-through writes
    then in flight (how many landed varies from run to run: 0, 12, 24 or
    48 were seen), four rounds. The orphans a kill leaves (blocks whose
    parent never landed) are cleared at restart. After every restart each
    prefix saved so far loads byte-exact
    as far as the SSD recovered it, the rest is a miss, no block fails its
    checksum (a record goes valid only after its write is reaped), and the
    blocks earlier rounds recovered stay."""
    n = 48
    inst = Instance(str(tmp_path / "ssd"), cpu="8MiB", ssd_capacity="32MiB")
    recovered: list[int] = []  # blocks each round's prefix kept, once a later restart saw them
    try:
        for r in range(4):
            s = inst.start()
            with client(s.endpoint, kv(r)) as c:
                assert c.save(tokens(n, start=5_000 * r), np.arange(n)).wait() == n * BLOCK_TOKENS
                s.kill()  # (the tier's cached_blocks counts writes in flight: no use waiting on it)
            s = inst.start()
            dst = kv(None)
            with client(s.endpoint, dst) as c:
                assert c.stats()["tiers"]["cpu"]["used_blocks"] == 0
                kept = []
                for q in range(r + 1):
                    prefix = tokens(n, start=5_000 * q)
                    looked = c.lookup(prefix) // BLOCK_TOKENS
                    loaded = c.load(prefix, np.arange(n)).wait() // BLOCK_TOKENS
                    assert loaded == looked
                    assert blocks_of(dst, np.arange(loaded)) == blocks_of(kv(q), np.arange(loaded))
                    kept.append(loaded)
                assert kept[:r] == recovered  # what an earlier restart recovered stays
                assert ssd_stats(c)["checksum_failures"] == 0
                assert ssd_stats(c)["cached_blocks"] == sum(kept)
                recovered = kept
            assert s.stop() == 0
    finally:
        inst.cleanup()


def test_blocks_evicted_from_ssd_stay_gone_after_a_clean_restart(tmp_path):
    """An evicted SSD block keeps its journal record until its slot is
    written again; a clean stop clears those, so the next start recovers
    exactly what was indexed, not blocks evicted (or deleted) before."""
    inst = Instance(
        str(tmp_path / "ssd"), "--set", "ssd_capacity_per_dir=1MiB", "--set", "evict_ratio=0.5"
    )
    try:
        s = inst.start()
        with client(s.endpoint, kv(5)) as c:
            assert ssd_stats(c)["capacity_blocks"] == 8

            def save(n: int, start: int = 0) -> None:
                c.save(tokens(n, start=start), np.arange(n)).wait()
                wait_for(lambda: c.stats()["plans_in_flight"] == 0)

            save(1)
            save(2)  # a block below the first one's
            save(3, 5000)
            c.load(tokens(1), np.arange(40, 41)).wait()  # the first block used again
            save(2, 6000)  # 7 of 8 SSD slots used
            save(2, 7000)  # one short: 4 blocks evicted at once (evict_ratio), 2 reused
            before = ssd_stats(c)
            assert before["evicted_blocks"] == 4 and before["cached_blocks"] == 5
        assert s.stop() == 0
        s = inst.start()
        with client(s.endpoint, kv(None)) as c:
            assert ssd_stats(c)["cached_blocks"] == 5  # not the 2 evicted, unused slots too
            assert c.lookup(tokens(2, start=7000)) == 2 * BLOCK_TOKENS
        assert s.stop() == 0
    finally:
        inst.cleanup()


def test_deleted_blocks_stay_deleted_after_a_restart(instance):
    s = instance.start()
    with client(s.endpoint, kv(12)) as c:
        c.save(tokens(6), np.arange(6)).wait()
        wait_for(lambda: on_ssd(c, 6))
        assert c.delete(tokens(4)) == 2 * 3  # blocks 3..5, from CPU and SSD
        assert c.lookup(tokens(6)) == 3 * BLOCK_TOKENS
    assert s.stop() == 0
    s = instance.start()
    with client(s.endpoint, kv(None)) as c:
        assert ssd_stats(c)["cached_blocks"] == 3
        assert c.lookup(tokens(6)) == 3 * BLOCK_TOKENS
    assert s.stop() == 0


def test_a_corrupted_block_misses_and_its_prefix_still_loads(instance, asked):
    s = instance.start()
    src = kv(4)
    with client(s.endpoint, src) as c:
        c.save(tokens(5), np.arange(5)).wait()
        wait_for(lambda: on_ssd(c, 5))
    assert s.stop() == 0
    data = [f for f in os.listdir(instance.ssd_dir) if f.endswith(".data")]
    path = os.path.join(instance.ssd_dir, data[0])
    slot_bytes = 2 * 64 * 1024  # fresh SSD slots go out in order: block i in slot i
    with open(path, "r+b") as f:
        f.seek(2 * slot_bytes + 1000)
        byte = f.read(1)
        f.seek(2 * slot_bytes + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    s = instance.start()
    dst = kv(None)
    with client(s.endpoint, dst) as c:
        loaded = c.load(tokens(5), np.arange(40, 45)).wait()
        assert loaded == 2 * BLOCK_TOKENS  # blocks 0 and 1; 2 is corrupt, 3 and 4 hang below it
        assert blocks_of(dst, np.arange(40, 42)) == blocks_of(src, np.arange(2))
        assert ssd_stats(c)["checksum_failures"] == 1
        assert c.lookup(tokens(5)) == 2 * BLOCK_TOKENS
        gauges = {x.name: x.value for m in StatsCollector(c.stats).collect() for x in m.samples}
        assert gauges["kvsidecar_ssd_checksum_failures_total"] == 1
        assert gauges["kvsidecar_ssd_io_errors_total"] == 0
    assert s.stop() == 0


def test_an_unreadable_block_is_dropped_once_and_its_prefix_still_loads(instance, asked):
    """The data file cut short under a running sidecar: reading the blocks
    past its end fails (EIO, as a bad sector does). They are dropped, and
    counted, the first time, so later loads neither fail nor read them
    again, and the blocks before them still load."""
    s = instance.start()
    src = kv(6)
    with client(s.endpoint, src) as c:
        c.save(tokens(5), np.arange(5)).wait()
        wait_for(lambda: on_ssd(c, 5))
        fill_cpu(c, 16)  # the 5 blocks now live on SSD alone
        wait_for(lambda: c.stats()["plans_in_flight"] == 0)
        data = [f for f in os.listdir(instance.ssd_dir) if f.endswith(".data")]
        slot_bytes = 2 * 64 * 1024  # fresh SSD slots go out in order: block i in slot i
        os.truncate(os.path.join(instance.ssd_dir, data[0]), 2 * slot_bytes)
        dst = kv(None)
        with client(s.endpoint, dst) as d:
            for _ in range(2):
                assert d.load(tokens(5), np.arange(40, 45)).wait() == 2 * BLOCK_TOKENS
                assert blocks_of(dst, np.arange(40, 42)) == blocks_of(src, np.arange(2))
                assert ssd_stats(d)["io_errors"] == 3  # blocks 2-4, once
                assert ssd_stats(d)["checksum_failures"] == 0
                assert d.lookup(tokens(5)) == 2 * BLOCK_TOKENS
    assert s.stop() == 0


def test_a_small_filesystem_caps_the_tier_and_nothing_breaks(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "size=2m") as mnt:
        inst = Instance(str(mnt / "ssd"))
        try:
            s = inst.start()
            src = kv(5)
            with client(s.endpoint, src) as c:
                cap = ssd_stats(c)["capacity_blocks"]
                assert 0 < cap < 16  # 2 MiB of 128 KiB blocks, not the 8 MiB asked for
                for i in range(6):  # 24 blocks: more than the SSD tier holds
                    c.save(tokens(4, start=1000 * i), np.arange(4)).wait()
                    wait_for(lambda: c.stats()["plans_in_flight"] == 0)
                assert ssd_stats(c)["used_blocks"] <= cap and ssd_stats(c)["io_errors"] == 0
                assert c.lookup(tokens(4, start=5000)) == 4 * BLOCK_TOKENS
            assert s.stop() == 0
        finally:
            inst.cleanup()


@pytest.fixture
def failing_disk(tmp_path):
    """An ext4 on a loop device whose backing file can be made immutable:
    the loop driver then fails every write with EIO, as a dying disk does.
    Yields (mount point, make_writes_fail)."""
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if loop.returncode != 0:
        pytest.skip(f"no loop device here: {loop.stderr.strip()}")
    device = loop.stdout.strip()
    try:
        for cmd in (["mkfs.ext4", "-q", "-O", "^has_journal", device], ["mount", device, str(mnt)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"{cmd[0]} failed here: {done.stderr.strip()}")

        def make_writes_fail() -> None:
            done = subprocess.run(["chattr", "+i", str(image)], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"chattr failed here: {done.stderr.strip()}")

        yield mnt, make_writes_fail
    finally:
        subprocess.run(["chattr", "-i", str(image)], capture_output=True)
        subprocess.run(["umount", str(mnt)], capture_output=True)
        subprocess.run(["losetup", "-d", device], capture_output=True)


def test_disk_write_errors_are_counted_and_the_sidecar_keeps_serving(failing_disk):
    mnt, make_writes_fail = failing_disk
    inst = Instance(str(mnt / "ssd"))
    try:
        s = inst.start()
        src = kv(8)
        with client(s.endpoint, src) as c:
            assert c.save(tokens(3), np.arange(3)).wait() == 3 * BLOCK_TOKENS
            wait_for(lambda: on_ssd(c, 3))
            make_writes_fail()
            c.save(tokens(3, start=5000), np.arange(3, 6)).wait()
            wait_for(lambda: c.stats()["plans_in_flight"] == 0)
            assert ssd_stats(c)["io_errors"] >= 1
            assert ssd_stats(c)["cached_blocks"] == 3  # nothing half-written counts
            # The blocks are not on SSD, but the CPU tier still serves them.
            assert c.lookup(tokens(3, start=5000)) == 3 * BLOCK_TOKENS
            fill_cpu(c)  # the first prefix now lives on SSD alone: reads still work
            dst = kv(None)
            with client(s.endpoint, dst) as d:
                assert d.load(tokens(3), np.arange(3)).wait() == 3 * BLOCK_TOKENS
                assert blocks_of(dst, np.arange(3)) == blocks_of(src, np.arange(3))
        assert s.stop() == 0
    finally:
        inst.cleanup()


def test_a_vanished_directory_costs_its_blocks_and_nothing_else(instance):
    s = instance.start()
    src = kv(9)
    with client(s.endpoint, src) as c:
        assert c.save(tokens(3), np.arange(3)).wait() == 3 * BLOCK_TOKENS
        wait_for(lambda: on_ssd(c, 3))
        shutil.rmtree(instance.ssd_dir)  # its files stay open: writes go on, unseen
        assert c.save(tokens(2, start=7000), np.arange(3, 5)).wait() == 2 * BLOCK_TOKENS
        wait_for(lambda: on_ssd(c, 5))
    assert s.stop() == 0
    s = instance.start()  # the directory is made again, empty
    with client(s.endpoint, kv(None)) as c:
        assert ssd_stats(c)["cached_blocks"] == 0 and c.lookup(tokens(3)) == 0
        assert c.save(tokens(3), np.arange(3)).wait() == 3 * BLOCK_TOKENS
        wait_for(lambda: on_ssd(c, 3))
    assert s.stop() == 0
    assert os.path.isdir(instance.ssd_dir)


def test_a_parked_load_is_not_tried_again_by_plans_whose_end_frees_no_slot(instance):
    """A load short of CPU slots is tried again when a slot may have come
    free (one freed, a block become evictable), not whenever a plan ends:
    each try costs one of its staging attempts, and another engine's loads
    (each part of a load in parts is one) end plans that free nothing."""
    s = instance.start()
    src = kv(12)
    a_tokens, b_tokens = tokens(2, start=10_000), tokens(8)
    with client(s.endpoint, src) as c, client(s.endpoint, kv(13)) as w:
        c.save(a_tokens, np.arange(10, 12)).wait()
        c.save(b_tokens[: 4 * BLOCK_TOKENS], np.arange(4)).wait()
        wait_for(lambda: on_ssd(c, 6))
        channel = Channel(s.endpoint, 5.0)
        try:
            # W's open save of B's blocks 4-7 holds the other 4 CPU slots
            # (A's were evicted for them): B's blocks 0-3 sit above blocks
            # not ready, so nothing in the tier can be evicted.
            save = p.Save(v=1, id=0, session=w.session, skip=4)
            b_frames = [p.keys_frame(w.block_keys(b_tokens)), p.ids_frame(np.arange(8))]
            held = channel.call(save, b_frames)[0]
            assert held.stored_blocks == 4
            assert c.lookup_tiers(a_tokens).cpu == 0
            load_a = p.Load(v=1, id=0, session=c.session)
            a_frames = [p.keys_frame(c.block_keys(a_tokens)), p.ids_frame(np.arange(20, 22))]
            rid = channel.send(load_a, a_frames)
            channel.call(p.Stats(v=1, id=0))  # handled in order: A's load parked
            for _ in range(2 * 4):  # more plans than A has tries
                load_b = p.Load(v=1, id=0, session=c.session)
                b_head = [p.keys_frame(c.block_keys(b_tokens[: 4 * BLOCK_TOKENS]))]
                reply = channel.call(load_b, [*b_head, p.ids_frame(np.arange(30, 34))])[0]
                assert reply.hit_blocks == 4
                channel.call(p.Cancel(v=1, id=0, session=c.session, plan_id=reply.plan_id))
            channel.call(p.Stats(v=1, id=0))
            assert rid not in channel._early, "A was answered while no slot was free"
            channel.call(p.Cancel(v=1, id=0, session=w.session, plan_id=held.plan_id))
            reply, _ = channel.wait_reply(rid, 5.0)  # W's 4 slots freed: A is staged
            assert reply.hit_blocks == 2, reply
            channel.call(p.Cancel(v=1, id=0, session=c.session, plan_id=reply.plan_id))
        finally:
            channel.close()
        wait_for(lambda: c.stats()["plans_in_flight"] == 0)
    assert s.stop() == 0


def test_a_load_parked_behind_a_save_rolled_back_for_an_orphan_is_answered(tmp_path):
    """W's save holds every CPU slot; A's load parks. W goes silent and its
    lease runs out: the save is rolled back (no end reported to the loads
    waiting) and its slots stay held for the orphan, so nothing is freed and
    nothing made evictable. A is answered then (with what the tier holds),
    not only when the orphan is released 10 leases later (found by review:
    A waited 22 s, past any client's timeout)."""
    inst = Instance(str(tmp_path / "ssd"), "--set", "lease_seconds=2")
    try:
        s = inst.start()
        a_tokens, b_tokens = tokens(2, start=10_000), tokens(8)
        with client(s.endpoint, kv(12)) as c, client(s.endpoint, kv(13)) as w:
            c.save(a_tokens, np.arange(10, 12)).wait()
            wait_for(lambda: on_ssd(c, 2))
            assert w._link.heartbeat is not None
            w._link.heartbeat.stop()  # W's process lives on, but goes silent
            channel = Channel(s.endpoint, 60.0)
            try:
                save = p.Save(v=1, id=0, session=w.session)
                frames = [p.keys_frame(w.block_keys(b_tokens)), p.ids_frame(np.arange(8))]
                assert channel.call(save, frames)[0].stored_blocks == 8  # every CPU slot
                load_a = p.Load(v=1, id=0, session=c.session)
                a_frames = [p.keys_frame(c.block_keys(a_tokens)), p.ids_frame(np.arange(20, 22))]
                rid = channel.send(load_a, a_frames)
                channel.call(p.Stats(v=1, id=0))
                assert rid not in channel._early, "A's load was answered at once"
                reply, _ = channel.wait_reply(rid, 60.0)
                assert reply.hit_blocks == 0  # the slots are still the orphan's
                assert c.stats()["orphaned_plans"] == 1, "answered only once the orphan went"
            finally:
                channel.close()
        assert s.stop() == 0
    finally:
        inst.cleanup()


def test_a_load_in_parts_keeps_its_staged_blocks_from_a_load_short_of_slots(instance):
    """B's 7 blocks, staged into the 8-slot CPU tier, are asked for a block
    a part. Each part's plan locks every staged block, not only its own: A's
    load (2 blocks, 1 slot free), arriving between B's parts, cannot evict
    the blocks of B's parts not yet asked for (before, it took B's last
    block, whose part came back empty). A gets what the free slot holds."""
    s = instance.start()
    src = kv(12)
    a_tokens, b_tokens = tokens(2, start=10_000), tokens(7)
    with client(s.endpoint, src) as c:
        c.save(b_tokens, np.arange(7)).wait()
        wait_for(lambda: on_ssd(c, 7))  # written: the next save may evict them
        c.save(a_tokens, np.arange(10, 12)).wait()
        wait_for(lambda: on_ssd(c, 9))
    assert s.stop() == 0
    s = instance.start()  # the CPU tier empty, the SSD's 9 blocks recovered
    with client(s.endpoint, kv(None)) as b, client(s.endpoint, kv(None)) as a:
        channel = Channel(s.endpoint, 5.0)
        try:
            b_frames = [p.keys_frame(b.block_keys(b_tokens)), p.ids_frame(np.arange(7))]

            def part(k: int) -> int:
                """B's part k (block k), answered; its plan left open."""
                load = p.Load(v=1, id=0, session=b.session, skip=k, end=k + 1)
                reply = channel.call(load, b_frames)[0]
                assert reply.hit_blocks == 1, (k, reply)  # its block was kept for it
                return int(reply.plan_id)

            open_plan = part(0)  # stages all 7 of B's blocks
            wait_for(lambda: b.lookup_tiers(b_tokens).cpu == 7 * BLOCK_TOKENS)  # staging done
            load_a = p.Load(v=1, id=0, session=a.session)
            a_frames = [p.keys_frame(a.block_keys(a_tokens)), p.ids_frame(np.arange(20, 22))]
            for k in range(1, 7):
                nxt = part(k)  # asked before the part before it ends, as parts.py does
                channel.call(p.Cancel(v=1, id=0, session=b.session, plan_id=open_plan))
                open_plan = nxt
                if k == 1:
                    rid = channel.send(load_a, a_frames)
            channel.call(p.Cancel(v=1, id=0, session=b.session, plan_id=open_plan))
            reply, _ = channel.wait_reply(rid, 5.0)
            assert reply.hit_blocks >= 1, reply  # 2 if it was tried after B's last part
            channel.call(p.Cancel(v=1, id=0, session=a.session, plan_id=reply.plan_id))
        finally:
            channel.close()
    assert s.stop() == 0
