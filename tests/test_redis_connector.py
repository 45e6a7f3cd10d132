"""The Redis connector and the remote value format, against real servers."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from redis.cluster import RedisCluster, key_slot
from redis_servers import RedisClusterOf3, RedisServer
from sidecar_proc import free_port, wait_for

from sidecar.tiers.remote.connector import Connector, Later, RemoteUnavailable
from sidecar.tiers.remote.redis import RedisConnector
from sidecar.tiers.remote.store import FRONT_BYTES, ReadResult, RemoteStore

BLOCK = 64 << 10


def slots(n: int, seed: int) -> np.ndarray:
    """n page-aligned block buffers (as shm slots are) of random bytes."""
    raw = np.empty(n * BLOCK + 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    out = raw[start : start + n * BLOCK].reshape(n, BLOCK)
    out[:] = np.random.default_rng(seed).integers(0, 256, out.shape, dtype=np.uint8)
    return out


def test_batches_round_trip_values_sent_as_chunks(connector):
    blocks = slots(5, 1)
    keys = [b"k%d" % i for i in range(5)]
    values = [[b"head%d" % i, memoryview(blocks[i])] for i in range(5)]
    assert connector.put(keys, values) == [True] * 5
    got = connector.get([*keys, b"absent"])
    assert got[-1] is None
    for i in range(5):
        assert got[i] == b"head%d" % i + blocks[i].tobytes()
    assert connector.heads([keys[0], b"absent", keys[4]], 5) == [b"head0", None, b"head4"]
    assert connector.delete([keys[0], b"absent"]) == 1
    assert connector.heads([keys[0]], 5) == [None]
    assert connector.get([]) == [] and connector.put([], []) == []


def test_put_rejects_mismatched_batches(connector):
    with pytest.raises(ValueError):
        connector.put([b"a", b"b"], [[b"x"]])


def test_values_put_with_a_ttl_expire_in_the_store(server, connector):
    assert connector.put([b"t1", b"t2"], [[b"a"], [b"b"]], ttl=0.0015) == [True, True]
    assert connector.put([b"kept"], [[b"c"]]) == [True]
    with server.client() as r:
        wait_for(lambda: r.exists(b"t1", b"t2") == 0)  # 2 ms: a TTL rounded up, not to 0
        assert r.pttl(b"kept") == -1
    connector.put([b"t3"], [[b"d"]], ttl=30)
    with server.client() as r:
        assert 0 < r.pttl(b"t3") <= 30_000
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttl"):
            connector.put([b"t4"], [[b"e"]], ttl=bad)


def test_a_store_refusing_a_write_fails_that_key_only(server, connector):
    with server.client() as r:
        r.config_set("maxmemory", r.info("memory")["used_memory"] + (1 << 20))
        r.config_set("maxmemory-policy", "noeviction")
    big = slots(40, 2)  # 2.5 MiB: past the limit part way through
    stored = connector.put([b"b%d" % i for i in range(40)], [[memoryview(b)] for b in big])
    assert stored[0] and not stored[-1]
    assert connector.heads([b"b0"], 1) == [big[0][:1].tobytes()]


def test_a_dead_server_raises_unavailable_within_the_timeout(redis_bin):
    c = RedisConnector(f"redis://127.0.0.1:{free_port()}", timeout=0.3)
    start = time.monotonic()
    for call in (lambda: c.get([b"x"]), c.ping, lambda: c.put([b"x"], [[b"v"]])):
        with pytest.raises(RemoteUnavailable):
            call()
    assert time.monotonic() - start < 3.0


def test_a_stopped_server_times_out_then_recovers(server):
    c = RedisConnector(server.url, timeout=0.3)
    c.put([b"k"], [[b"v"]])
    server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            c.get([b"k"])
        assert time.monotonic() - start < 2.0
    finally:
        server.resume()
    assert c.get([b"k"]) == [b"v"]
    c.close()


def test_store_reads_good_blocks_and_reports_bad_ones(server, connector):
    store = RemoteStore(connector, "ns", BLOCK)
    blocks = slots(4, 3)
    keys = [bytes([i]) * 16 for i in range(4)]
    assert store.write(keys, list(blocks)) == [True] * 4
    with server.client() as r:  # corrupt one byte of block 1, truncate block 2
        value = bytearray(r.get(store.name(keys[1])))
        value[FRONT_BYTES + 100] ^= 1
        r.set(store.name(keys[1]), bytes(value))
        r.set(store.name(keys[2]), r.get(store.name(keys[2]))[:-1])
        r.delete(store.name(keys[3]))
    targets = slots(4, 4)
    before = targets.copy()
    results = store.read(keys, list(targets))
    assert results == [ReadResult.HIT, ReadResult.CORRUPT, ReadResult.CORRUPT, ReadResult.MISSING]
    assert np.array_equal(targets[0], blocks[0])
    # Block 1 was received into its slot and failed its check there (the
    # caller drops it); a value of the wrong size is never read in.
    assert np.array_equal(targets[2:], before[2:])


def test_a_value_under_another_key_is_corrupt(server, connector):
    store = RemoteStore(connector, "ns", BLOCK)
    a, b = b"a" * 16, b"b" * 16
    store.write([a], [slots(1, 5)[0]])
    with server.client() as r:
        r.copy(store.name(a), store.name(b))
    assert store.read([b], [slots(1, 6)[0]]) == [ReadResult.CORRUPT]


def test_namespaces_keep_stores_apart(connector):
    one, two = RemoteStore(connector, "one", BLOCK), RemoteStore(connector, "two", BLOCK)
    key = b"k" * 16
    one.write([key], [slots(1, 7)[0]])
    assert one.present([key]) == [True] and two.present([key]) == [False]


def test_a_probe_counts_only_values_a_read_may_take(server, connector):
    """A value the reader takes as MISSING is left in the store; a probe
    that asked only whether the key exists counted it at every lookup."""
    store = RemoteStore(connector, "ns", BLOCK, secret=b"s" * 32)
    k = [bytes([i]) * 16 for i in range(6)]
    store.write(k[:1], [slots(1, 8)[0]])
    RemoteStore(connector, "ns", BLOCK).write(k[1:2], [slots(1, 9)[0]])  # another key id
    RemoteStore(connector, "ns", BLOCK // 2, secret=b"s" * 32).write(k[2:3], [slots(1, 9)[0]])
    with server.client() as r:
        r.set(store.name(k[3]), b"KVR2" + bytes(BLOCK))  # an older format
        r.rpush(store.name(k[4]), b"not a string")
        r.set(store.name(k[5]), b"short")
    assert store.present(k) == [True] + [False] * 5
    assert [r == ReadResult.HIT for r in store.read(k, list(slots(6, 10)))] == store.present(k)
    with pytest.raises(ValueError, match="nbytes"):
        connector.heads(k, 0)


def test_a_cluster_spreads_keys_over_its_nodes_and_round_trips(redis_bin):
    cluster = RedisClusterOf3().start()
    try:
        c = RedisConnector(cluster.url, timeout=2.0, cluster=True)
        store = RemoteStore(c, "kv", BLOCK)
        blocks = slots(24, 8)
        keys = [bytes([i]) * 16 for i in range(24)]
        assert store.write(keys, list(blocks)) == [True] * 24
        per_node = cluster.keys_per_node()
        assert sum(per_node) == 24 and min(per_node) > 0
        targets = slots(24, 9)
        assert store.read(keys, list(targets)) == [ReadResult.HIT] * 24
        assert np.array_equal(targets, blocks)
        c.ping()
        assert store.delete(keys[:3]) == 3
        c.close()
    finally:
        cluster.cleanup()


class QuickFailoverNode(RedisServer):
    def args(self) -> list[str]:
        return [*super().args(), "--cluster-node-timeout", "1000"]


def test_a_cluster_that_failed_over_is_used_again_without_a_restart(redis_bin):
    """After a failover every op went to the dead primary's address (the
    slot map was read again only on a MOVED reply) and the tier stayed
    offline until the sidecar restarted: an unreachable node now has the
    map read again, from every node it knew."""
    import subprocess

    nodes = [QuickFailoverNode(cluster=True) for _ in range(4)]
    try:
        for node in nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        run = {"capture_output": True, "check": True, "timeout": 60}
        subprocess.run(["redis-cli", "--cluster", "create", *addresses[:3], "--cluster-yes"], **run)
        wait_for(lambda: all(RedisClusterOf3._ok(n) for n in nodes[:3]))
        with nodes[0].client() as r:
            primary = r.execute_command("CLUSTER", "MYID").decode()
        add = ["redis-cli", "--cluster", "add-node", addresses[3], addresses[0]]
        subprocess.run([*add, "--cluster-slave", "--cluster-master-id", primary], **run)

        def replicating() -> bool:
            with nodes[3].client() as r:
                return r.info("replication").get("master_link_status") == "up"

        wait_for(replicating)
        c = RedisConnector(nodes[1].url, timeout=0.3, cluster=True)
        store = RemoteStore(c, "kv", BLOCK)
        keys = [bytes([i]) * 16 for i in range(24)]
        blocks = slots(24, 8)
        assert store.write(keys, list(blocks)) == [True] * 24
        with nodes[0].client() as r:  # replicated before the primary goes
            assert r.execute_command("WAIT", 1, 60_000) == 1
            held = r.dbsize()

        def in_sync() -> bool:  # a link dropped on a loaded machine resyncs from empty
            with nodes[3].client() as r:
                info = r.info("replication")
                synced = info.get("master_link_status") == "up"
                return synced and not info.get("master_sync_in_progress") and r.dbsize() == held

        wait_for(in_sync)
        nodes[0].kill()

        def failed_over() -> bool:
            with nodes[3].client() as r:
                promoted = r.info("replication")["role"] == "master"
            return promoted and RedisClusterOf3._ok(nodes[1]) and RedisClusterOf3._ok(nodes[3])

        wait_for(failed_over, timeout=60)

        def pings() -> bool:
            try:
                c.ping()
                return True
            except RemoteUnavailable:  # the dead primary's address, once
                return False

        wait_for(pings)
        targets = slots(24, 9)

        names = [store.name(k) for k in keys]

        def kept() -> list[bool]:
            """Which keys the cluster holds now: a replica whose link dropped
            just before the kill (a loaded machine) was promoted empty, its
            share of the keys lost by Redis, not by the tier."""
            with RedisCluster(host="127.0.0.1", port=nodes[1].port) as cluster:
                return [bool(cluster.exists(name)) for name in names]

        def all_read() -> bool:  # a node that learns of the failover late answers MOVED once
            expected = [ReadResult.HIT if k else ReadResult.MISSING for k in kept()]
            return store.read(keys, list(targets)) == expected

        wait_for(all_read)  # long: a loaded machine's reads time out (0.3 s) too
        there = np.array(kept())
        assert there.sum() >= 16  # two primaries' keys at least: they never went
        assert np.array_equal(targets[there], blocks[there])
        c.close()
    finally:
        for node in nodes:
            node.cleanup()


def parts_of(targets: np.ndarray, head: int) -> tuple[list[bytearray], list[list[memoryview]]]:
    """For each target block: a `head`-byte buffer, then the block, as get_into takes them."""
    heads = [bytearray(head) for _ in targets]
    return heads, [[memoryview(h), memoryview(t)] for h, t in zip(heads, targets, strict=True)]


@pytest.mark.parametrize("size", [5, BLOCK, 3 << 20])
def test_get_into_receives_values_into_the_buffers(server, connector, size):
    rng = np.random.default_rng(size)
    values = [rng.bytes(size + 7) for _ in range(6)]
    keys = [b"v%d" % i for i in range(6)]
    assert connector.put(keys, [[v] for v in values]) == [True] * 6
    with server.client() as r:
        r.set(keys[2], values[2][:-1])  # a value one byte short
        r.delete(keys[3])
        r.delete(keys[4])
        r.rpush(keys[4], b"x")  # GET answers WRONGTYPE
    targets = np.zeros((6, size), dtype=np.uint8)
    heads, buffers = parts_of(targets, 7)
    assert connector.get_into(keys, buffers) == [True, True, False, None, None, True]
    for i in (0, 1, 5):
        assert bytes(heads[i]) + targets[i].tobytes() == values[i]
    for i in (2, 3, 4):
        assert not any(heads[i]) and not targets[i].any(), "a bad value's buffers are untouched"
    # Every reply was consumed: the pooled connection serves the next call in step.
    assert connector.get([keys[0], keys[5]]) == [values[0], values[5]]
    assert connector.get_into([], []) == []
    with pytest.raises(ValueError):
        connector.get_into(keys, buffers[:2])


def test_get_into_times_out_then_recovers(server):
    c = RedisConnector(server.url, timeout=0.3)
    c.put([b"k"], [[b"h", b"v" * BLOCK]])
    buf = np.zeros(BLOCK + 1, dtype=np.uint8)
    server.pause()
    try:
        with pytest.raises(RemoteUnavailable):
            c.get_into([b"k"], [[memoryview(buf)]])
    finally:
        server.resume()
    assert c.get_into([b"k"], [[memoryview(buf)]]) == [True]
    assert buf.tobytes() == b"h" + b"v" * BLOCK
    c.close()


@contextlib.contextmanager
def scripted_server(get_reply: bytes) -> Iterator[str]:
    """A TCP server that answers each GET with `get_reply` and anything
    else (redis-py's CLIENT SETINFO at connect) with +OK; yields its URL.
    For replies a healthy Redis does not give on demand."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                while request := conn.recv(65536):
                    conn.sendall(get_reply if b"GET" in request else b"+OK\r\n")

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.mark.parametrize(
    "reply, error",
    [
        (b":1\r\n", "a GET answered b':1'"),  # out of step
        (b"$5x\r\n", "a GET answered"),
        (b"-LOADING Redis is loading the dataset in memory\r\n", "loading"),
        (b"-NOAUTH Authentication required.\r\n", "Authentication required"),
    ],
)
def test_replies_that_say_the_server_cannot_serve_make_it_unavailable(reply, error):
    """Not read as data, nor as "absent" (which would drop every block from
    the remote index): the batch fails as the store being unavailable, and
    the connection is dropped."""
    with scripted_server(reply) as url:
        c = RedisConnector(url, timeout=1.0)
        buf = np.zeros(8, dtype=np.uint8)
        try:
            with pytest.raises(RemoteUnavailable, match=error):
                c.get_into([b"k"], [[memoryview(buf)]])
            assert not buf.any()
        finally:
            c.close()


class _DictConnector(Connector):
    """The smallest connector: what the base class's get_into is built on."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}

    def get(self, keys):
        return [self.values.get(k) for k in keys]

    def put(self, keys, values, ttl=None):
        for k, v in zip(keys, values, strict=True):
            self.values[k] = b"".join(bytes(c.made() if isinstance(c, Later) else c) for c in v)
        return [True] * len(keys)

    def heads(self, keys, nbytes):
        return [v[:nbytes] if len(v := self.values.get(k, b"")) >= nbytes else None for k in keys]

    def delete(self, keys):
        return sum(self.values.pop(k, None) is not None for k in keys)

    def ping(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_default_get_into_matches_the_redis_one(connector):
    plain = _DictConnector()
    keys = [b"a", b"b", b"c"]
    values = [b"0123456789", b"short", b"9876543210"]
    for c in (plain, connector):
        c.put(keys, [[v] for v in values])
        targets = np.zeros((4, 6), dtype=np.uint8)
        heads, buffers = parts_of(targets, 4)
        assert c.get_into([*keys, b"absent"], buffers) == [True, False, True, None]
        assert bytes(heads[0]) + targets[0].tobytes() == values[0]
        assert bytes(heads[2]) + targets[2].tobytes() == values[2]
        assert not targets[1].any() and not targets[3].any()


def _round_trip_1100_blocks(url: str) -> None:
    c = RedisConnector(url, timeout=5.0)
    store = RemoteStore(c, "big", 20 << 10)
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (1100, 20 << 10), dtype=np.uint8)
    keys = [rng.bytes(16) for _ in range(1100)]
    assert store.write(keys, list(blocks)) == [True] * 1100
    targets = np.zeros_like(blocks)
    assert store.read(keys, list(targets)) == [ReadResult.HIT] * 1100
    assert np.array_equal(targets, blocks)
    c.close()


def test_a_batch_of_more_chunks_than_one_sendmsg_takes(server):
    """1,100 blocks of 20 KiB: ~2,200 chunks, more than IOV_MAX (1,024)."""
    _round_trip_1100_blocks(server.url)
    with server.client() as r:
        assert r.dbsize() == 1100


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_round_trip(redis_bin):
    """A TLS socket has no sendmsg (one sendall per chunk there) and GET
    values are received through it with recv_into."""
    tls = RedisServer(tls=True).start()
    try:
        _round_trip_1100_blocks(tls.url)
        with tls.client() as r:
            assert r.dbsize() == 1100
        # Blocks of 2 MiB go in pieces, each hashed after its sendall.
        c = RedisConnector(tls.url, timeout=10.0)
        store = RemoteStore(c, "streamed", 2 << 20)
        assert store._pieces is not None
        blocks = np.random.default_rng(12).integers(0, 256, (3, 2 << 20), dtype=np.uint8)
        keys = [bytes([i]) * 16 for i in range(3)]
        assert store.write(keys, list(blocks)) == [True] * 3
        targets = np.zeros_like(blocks)
        assert store.read(keys, list(targets)) == [ReadResult.HIT] * 3
        assert np.array_equal(targets, blocks)
        c.close()
    finally:
        tls.cleanup()


def test_resp3_connections_read_absent_keys_as_absent(server):
    c = RedisConnector(server.url + "?protocol=3", timeout=2.0)
    c.put([b"k"], [[b"12345"]])
    buf = bytearray(5)
    assert c.get_into([b"k", b"absent"], [[memoryview(buf)], [memoryview(bytearray(5))]]) == [
        True,
        None,
    ]
    assert buf == b"12345"
    assert c.get([b"k", b"absent"]) == [b"12345", None]
    c.close()


def test_a_moved_slot_is_found_again_after_one_failed_batch(redis_bin):
    """A slot moved behind the connector's back: the batch that meets MOVED
    fails that key, and the next one, on the refreshed slot map, lands."""
    cluster = RedisClusterOf3().start()
    try:
        c = RedisConnector(cluster.url, timeout=5.0, cluster=True)
        key = b"moved-key"
        assert c.put([key], [[b"v1"]]) == [True]
        ids = {}
        for node in cluster.nodes:
            with node.client() as r:
                ids[node.port] = r.execute_command("CLUSTER", "MYID").decode()
        owner = c._topology().get_node_from_key(key).port
        target = next(port for port in ids if port != owner)
        for node in cluster.nodes:
            with node.client() as r:
                if node.port == owner:
                    r.delete(key)
                r.execute_command("CLUSTER", "SETSLOT", key_slot(key), "NODE", ids[target])
        assert c.put([key], [[b"v2"]]) == [False]
        assert c.put([key], [[b"v2"]]) == [True]
        assert c.get([key]) == [b"v2"]
        buf = bytearray(2)
        assert c.get_into([key], [[memoryview(buf)]]) == [True] and buf == b"v2"
        c.close()
    finally:
        cluster.cleanup()


def test_a_test_server_whose_port_was_taken_starts_on_another() -> None:
    """The set-up's own retry: free_port() races other processes (xdist)."""
    first = RedisServer().start()
    second = RedisServer()
    try:
        second.port = first.port  # taken: this server exits at once
        second.start()
        assert second.port != first.port
        with second.client() as r:
            assert r.ping()
    finally:
        first.cleanup()
        second.cleanup()
