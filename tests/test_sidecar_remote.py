"""The remote tier through real sidecars and real Redis servers: sharing
across "hosts", a cluster, a server killed mid-load, the put quota."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from redis_servers import RedisClusterOf3, RedisServer
from sidecar_proc import MODEL, Sidecar, stats_of, tokens, wait_for

from engine_shim import KVClient, parts
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.control.graph import OpKind, TransferOp
from sidecar.metrics.prometheus import StatsCollector
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.remote.ops import RemoteOps
from sidecar.tiers.remote.redis import RedisConnector
from sidecar.tiers.remote.store import RemoteStore

# 128 KiB blocks (2 layers of 64 KiB).
SHAPE = (32, 2, 16, 8, 64)
BLOCK_TOKENS = 16
N = 8


def kv(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(2)]


def client(s: Sidecar, cache: list[torch.Tensor]) -> KVClient:
    c = KVClient.connect(s.endpoint, timeout=5.0)
    c.register(cache, **{**MODEL, "num_kv_heads": 8, "head_dim": 64})
    return c


def blocks_of(cache: list[torch.Tensor], ids: np.ndarray) -> list[bytes]:
    return [layer[torch.as_tensor(ids)].numpy().tobytes() for layer in cache]


def remote(c: KVClient) -> dict:
    return c.stats()["tiers"]["remote"]


def settled(c: KVClient) -> bool:
    stats = c.stats()
    return stats["plans_in_flight"] == 0 and stats["tiers"]["remote"]["ops_in_flight"] == 0


class Hosts:
    """Sidecars that each play one host: own shm, own SSD directory."""

    def __init__(self, tmp_path, url: str, *extra: str) -> None:
        self.tmp_path, self.url, self.extra = tmp_path, url, extra
        self.sidecars: list[Sidecar] = []

    def start(self, *more: str) -> Sidecar:
        ssd = self.tmp_path / f"ssd{len(self.sidecars)}"
        s = Sidecar(
            "--set",
            f"remote_url={self.url}",
            "--set",
            f"ssd_dirs={ssd}",
            "--set",
            "ssd_capacity_per_dir=4MiB",
            *self.extra,
            *more,
        )
        self.sidecars.append(s)
        return s.start()

    def cleanup(self) -> None:
        for s in self.sidecars:
            s.cleanup()


@pytest.fixture
def server(redis_bin):
    s = RedisServer(persist=True).start()
    yield s
    s.cleanup()


def saved_to_the_store(s: Sidecar, seed: int) -> list[torch.Tensor]:
    """Blocks 0..N-1 of kv(seed) saved through `s`, every value written to
    the remote store; returns that KV."""
    src = kv(seed)
    with client(s, src) as c:
        assert c.save(tokens(N), np.arange(N)).wait() == N * BLOCK_TOKENS
        wait_for(lambda: remote(c)["cached_blocks"] == N and settled(c))
    return src


def save_on_one_load_on_the_other(hosts: Hosts) -> None:
    a, b = hosts.start(), hosts.start()
    assert a.shm_prefix != b.shm_prefix
    src = saved_to_the_store(a, 1)
    dst = kv(None)
    with client(b, dst) as c:
        assert c.lookup(tokens(N)) == N * BLOCK_TOKENS  # found by a probe of the store
        assert c.load(tokens(N), np.arange(10, 10 + N)).wait() == N * BLOCK_TOKENS
        assert blocks_of(dst, np.arange(10, 10 + N)) == blocks_of(src, np.arange(N))
        stats = c.stats()
        assert stats["hits"]["hit_blocks"]["remote"] == N
        assert stats["tiers"]["remote"]["found_blocks"] == N
        assert stats["tiers"]["remote"]["checksum_failures"] == 0
    for s in (a, b):
        assert s.stop() == 0
        assert s.shm_segments() == []


@pytest.mark.parametrize("streams", ["1", "3"])
def test_blocks_saved_through_one_host_load_byte_exact_through_another(
    tmp_path, server, streams, asked
):
    hosts = Hosts(tmp_path, server.url, "--set", f"remote_write_streams={streams}")
    try:
        save_on_one_load_on_the_other(hosts)
    finally:
        hosts.cleanup()


def test_a_load_in_parts_probes_the_store_once(tmp_path, server, monkeypatch):
    """Its parts come two at a time, each with every key: the second, asked
    while the first's probe is out, joins that probe instead of sending its
    own (so do lookups of one prompt from several engines)."""
    monkeypatch.setattr(parts, "PART_BYTES", 1)  # a block a part
    hosts = Hosts(tmp_path, server.url)
    try:
        a, b = hosts.start(), hosts.start()
        src = saved_to_the_store(a, 2)
        dst = kv(None)
        with client(b, dst) as c:
            assert c.load(tokens(N), np.arange(10, 10 + N)).wait() == N * BLOCK_TOKENS
            assert blocks_of(dst, np.arange(10, 10 + N)) == blocks_of(src, np.arange(N))
            stats = c.stats()
            assert stats["transfers"]["loads"] == N
            assert stats["tiers"]["remote"]["probes"] == 1
            assert stats["tiers"]["remote"]["probed_blocks"] == N
        for s in (a, b):
            assert s.stop() == 0
    finally:
        hosts.cleanup()


def test_the_same_through_a_three_node_cluster(tmp_path, redis_bin):
    cluster = RedisClusterOf3().start()
    hosts = Hosts(tmp_path, cluster.url, "--set", "remote_cluster=true")
    try:
        save_on_one_load_on_the_other(hosts)
        stored = cluster.keys_per_node()
        assert sum(stored) == N and sum(n > 0 for n in stored) >= 2, stored  # spread by slot
    finally:
        hosts.cleanup()
        cluster.cleanup()


@pytest.mark.parametrize("settle", [False, True])
def test_a_host_killed_while_writing_leaves_only_whole_values(tmp_path, server, settle):
    """SIGKILL a sidecar right after a 24-block save, while its remote writes
    are in flight (or once they have all been answered): another host then
    loads the prefix byte-exact as far as the store holds it (all of it
    once answered), and no value fails its check (a SET cut off with its
    connection is never stored: Redis applies a command once all of it has
    arrived)."""
    n = 24
    hosts = Hosts(tmp_path, server.url)
    try:
        a = hosts.start()
        src = kv(3)
        with client(a, src) as c:
            assert c.save(tokens(n), np.arange(n)).wait() == n * BLOCK_TOKENS
            if settle:
                wait_for(lambda: settled(c))
            a.kill()
        b = hosts.start()
        dst = kv(None)
        with client(b, dst) as c:
            looked = c.lookup(tokens(n)) // BLOCK_TOKENS
            loaded = c.load(tokens(n), np.arange(n)).wait() // BLOCK_TOKENS
            assert loaded == looked
            assert loaded == n or not settle
            assert blocks_of(dst, np.arange(loaded)) == blocks_of(src, np.arange(loaded))
            assert remote(c)["checksum_failures"] == 0
        assert b.stop() == 0
    finally:
        hosts.cleanup()


FAST_RETRY = (
    "--set",
    "remote_timeout_seconds=0.3",
    "--set",
    "remote_retry_seconds=0.2",
    "--set",
    "remote_retry_max_seconds=0.4",
)


def test_a_server_killed_mid_load_gives_misses_then_hits_after_its_restart(tmp_path, server, asked):
    hosts = Hosts(tmp_path, server.url, *FAST_RETRY)
    try:
        src = kv(2)
        with client(hosts.start(), src) as c:
            c.save(tokens(N), np.arange(N)).wait()
            wait_for(lambda: remote(c)["cached_blocks"] == N and settled(c))
        dst = kv(None)
        b = hosts.start()
        with client(b, dst) as c:
            probes = remote(c)["probes"]
            server.pause()  # the load's round trip to the store will hang...
            result: list[tuple[int, float]] = []
            start = time.monotonic()
            loader = threading.Thread(
                target=lambda: result.append(
                    (c.load(tokens(N), np.arange(N)).wait(), time.monotonic() - start)
                )
            )
            loader.start()
            # Asked on a channel of its own: the client is the loader's now.
            wait_for(lambda: stats_of(b)["tiers"]["remote"]["probes"] > probes)
            server.kill()  # ...and the server dies under it
            loader.join(10)
            assert result and result[0][0] == 0 and result[0][1] < 2.0, result
            for _ in range(3):  # down: misses, answered fast
                t = time.monotonic()
                assert c.load(tokens(N), np.arange(N)).wait() == 0
                assert c.lookup(tokens(N)) == 0
                assert time.monotonic() - t < 1.0
            assert remote(c)["online"] is False and remote(c)["outages"] == 1
            server.start()  # same port, same append-only file
            wait_for(lambda: remote(c)["online"])
            assert c.load(tokens(N), np.arange(20, 20 + N)).wait() == N * BLOCK_TOKENS
            assert blocks_of(dst, np.arange(20, 20 + N)) == blocks_of(src, np.arange(N))
            wait_for(lambda: settled(c))
    finally:
        hosts.cleanup()


def test_puts_past_the_quota_are_denied_and_counted_while_the_store_is_blocked(tmp_path, server):
    hosts = Hosts(
        tmp_path,
        server.url,
        "--set",
        "remote_put_quota_blocks=4",
        "--set",
        "remote_timeout_seconds=3",
        "--set",
        "remote_retry_seconds=0.2",
    )
    try:
        s = hosts.start()
        with client(s, kv(3)) as c:
            c.save(tokens(1, start=9000), np.arange(1)).wait()  # the tier is up and used
            wait_for(lambda: remote(c)["cached_blocks"] == 1 and settled(c))
            server.pause()
            try:
                assert c.save(tokens(4), np.arange(4)).wait() == 4 * BLOCK_TOKENS
                assert c.save(tokens(3, start=5000), np.arange(4, 7)).wait() == 3 * BLOCK_TOKENS
                assert c.save(tokens(2, start=7000), np.arange(7, 9)).wait() == 2 * BLOCK_TOKENS
                stats = remote(c)
                assert (stats["denied_puts"], stats["denied_blocks"]) == (2, 5)
                assert stats["puts_in_flight_blocks"] == 4
                wait_for(lambda: not remote(c)["online"])  # the blocked write timed out
            finally:
                server.resume()
            wait_for(lambda: remote(c)["online"] and settled(c))
            stats = c.stats()
            tiers = stats["tiers"]
            assert tiers["remote"]["puts_in_flight_blocks"] == 0
            assert tiers["remote"]["used_blocks"] == tiers["remote"]["cached_blocks"] == 1
            granted = sum(e["granted_slots"] for e in stats["engines"])  # the hot path's
            assert tiers["cpu"]["cached_blocks"] == 10
            assert tiers["cpu"]["used_blocks"] == 10 + granted
            assert c.lookup(tokens(4)) == 4 * BLOCK_TOKENS  # the CPU copies are whole
            c.save(tokens(2, start=11000), np.arange(2)).wait()  # the quota is free again
            wait_for(lambda: remote(c)["cached_blocks"] == 3 and settled(c))
            gauges = {
                (m.name, tuple(x.labels.values())): x.value
                for m in StatsCollector(c.stats).collect()
                for x in m.samples
            }
            assert gauges[("kvsidecar_remote_denied_blocks", ())] == 5
            assert gauges[("kvsidecar_remote_outages", ())] == 1
            assert gauges[("kvsidecar_remote_online", ())] == 1
            assert gauges[("kvsidecar_tier_cached_blocks", ("remote",))] == 3
        assert s.stop() == 0
    finally:
        hosts.cleanup()


def test_a_stop_does_not_wait_out_a_queue_of_writes_to_a_stalled_store(server):
    """The I/O pool ran every queued job at close: 128 remote writes to a
    store that answers nothing took a 2 s timeout each on 4 threads (64 s,
    past any service manager's stop timeout, which then SIGKILLs and leaves
    the shm). Jobs not started by then are dropped; running ones finish."""

    s = Sidecar(
        "--set",
        f"remote_url={server.url}",
        "--set",
        "remote_put_quota_blocks=100000",
        "--set",
        "remote_timeout_seconds=2",
        capacity="32MiB",  # 256 blocks: room for every write queued
    )
    try:
        s.start()
        c = client(s, kv(3))
        c.save(tokens(1, start=9000), np.arange(1)).wait()
        wait_for(lambda: remote(c)["cached_blocks"] == 1 and settled(c))
        server.pause()
        try:
            for j in range(128):
                c.save(tokens(1, start=100 * j), np.arange(1)).wait()
            assert remote(c)["puts_in_flight_blocks"] > 64
            assert s.proc is not None
            start = time.monotonic()
            s.terminate()
            assert s.proc.wait(60) == 0
            assert time.monotonic() - start < 30  # before: 64 s
            assert s.shm_segments() == []
        finally:
            server.resume()
            c.close()
    finally:
        s.cleanup()


def test_a_value_failing_its_checksum_is_a_miss_and_leaves_the_store(tmp_path, server):
    hosts = Hosts(tmp_path, server.url)
    try:
        src = kv(4)
        with client(hosts.start(), src) as c:
            c.save(tokens(N), np.arange(N)).wait()
            wait_for(lambda: remote(c)["cached_blocks"] == N and settled(c))
            bad = b"kvsidecar:" + c._keys(tokens(N))[5].tobytes().hex().encode()
        with server.client() as r:
            value = bytearray(r.get(bad))
            value[-1] ^= 0xFF
            r.set(bad, bytes(value))
        dst = kv(None)
        with client(hosts.start(), dst) as c:
            assert c.load(tokens(N), np.arange(N)).wait() == 5 * BLOCK_TOKENS
            assert blocks_of(dst, np.arange(5)) == blocks_of(src, np.arange(5))
            assert remote(c)["checksum_failures"] == 1
            wait_for(lambda: settled(c))
            # The slot the bad value was received into is never served.
            assert c.lookup(tokens(N)) == 5 * BLOCK_TOKENS
            assert c.load(tokens(N), np.arange(N)).wait() == 5 * BLOCK_TOKENS
        with server.client() as r:
            assert not r.exists(bad), "a corrupt value is removed from the store"
    finally:
        hosts.cleanup()


def test_a_store_down_at_start_is_used_once_it_comes_up(tmp_path, redis_bin):
    late = RedisServer()  # its port is chosen now; nothing listens there yet
    hosts = Hosts(tmp_path, late.url, *FAST_RETRY)
    try:
        with client(hosts.start(), kv(5)) as c:
            assert c.save(tokens(N), np.arange(N)).wait() == N * BLOCK_TOKENS
            wait_for(lambda: not remote(c)["online"])
            assert c.lookup(tokens(N)) == N * BLOCK_TOKENS  # the CPU tier serves meanwhile
            late.start()
            wait_for(lambda: remote(c)["online"])
            c.save(tokens(N, start=3000), np.arange(N)).wait()
            wait_for(lambda: remote(c)["cached_blocks"] == N and settled(c))
            with late.client() as r:
                assert r.dbsize() == N
    finally:
        hosts.cleanup()
        late.cleanup()


def test_a_write_is_split_over_write_streams_and_a_read_over_every_thread():
    store = RemoteStore(RedisConnector("redis://127.0.0.1:1"), "kv", 4096)  # never contacted
    pool = IoPool("remote-parts", 4)
    layout = BlockLayout(num_layers=1, layer_block_bytes=4096)
    with ShmPool.create(f"kvs-parts-{os.getpid()}", 1 << 20) as shm:
        ids = np.arange(8)
        for streams, want in ((1, 1), (3, 3), (9, 4)):  # at most one per thread
            ops = RemoteOps(store, pool, shm, layout, print, write_streams=streams)
            assert ops.parts(TransferOp(0, OpKind.H2REMOTE, ids, ids)) == want
            assert ops.parts(TransferOp(1, OpKind.REMOTE2H, ids, ids)) == 4
        with pytest.raises(ValueError, match="write_streams"):
            RemoteOps(store, pool, shm, layout, print, write_streams=0)
    pool.close()
