"""The Redis connector and the remote value format, against real servers."""

from __future__ import annotations

import time

import numpy as np
import pytest
from redis_servers import RedisClusterOf3, RedisServer, ensure_redis
from sidecar_proc import free_port

from sidecar.connector import RemoteUnavailable
from sidecar.redis_connector import RedisConnector
from sidecar.remote import HEADER_BYTES, ReadResult, RemoteStore

BLOCK = 64 << 10


@pytest.fixture(scope="session")
def redis_bin():
    ensure_redis()


@pytest.fixture
def server(redis_bin):
    s = RedisServer().start()
    yield s
    s.cleanup()


@pytest.fixture
def connector(server):
    c = RedisConnector(server.url, timeout=2.0)
    yield c
    c.close()


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
    assert connector.exists([keys[0], b"absent", keys[4]]) == [True, False, True]
    assert connector.delete([keys[0], b"absent"]) == 1
    assert connector.exists([keys[0]]) == [False]
    assert connector.get([]) == [] and connector.put([], []) == []


def test_put_rejects_mismatched_batches(connector):
    with pytest.raises(ValueError):
        connector.put([b"a", b"b"], [[b"x"]])


def test_a_store_refusing_a_write_fails_that_key_only(server, connector):
    with server.client() as r:
        r.config_set("maxmemory", r.info("memory")["used_memory"] + (1 << 20))
        r.config_set("maxmemory-policy", "noeviction")
    big = slots(40, 2)  # 2.5 MiB: past the limit part way through
    stored = connector.put([b"b%d" % i for i in range(40)], [[memoryview(b)] for b in big])
    assert stored[0] and not stored[-1]
    assert connector.exists([b"b0"]) == [True]


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
        value[HEADER_BYTES + 100] ^= 1
        r.set(store.name(keys[1]), bytes(value))
        r.set(store.name(keys[2]), r.get(store.name(keys[2]))[:-1])
        r.delete(store.name(keys[3]))
    targets = slots(4, 4)
    before = targets.copy()
    results = store.read(keys, list(targets))
    assert results == [ReadResult.HIT, ReadResult.CORRUPT, ReadResult.CORRUPT, ReadResult.MISSING]
    assert np.array_equal(targets[0], blocks[0])
    assert np.array_equal(targets[1:], before[1:]), "a bad value must not reach the slot"


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
    assert one.exists([key]) == [True] and two.exists([key]) == [False]


def test_a_cluster_spreads_keys_over_its_nodes_and_round_trips(redis_bin):
    cluster = RedisClusterOf3().start()
    try:
        c = RedisConnector(cluster.url, timeout=2.0, cluster=True)
        store = RemoteStore(c, "kv", BLOCK)
        blocks = slots(24, 8)
        keys = [bytes([i]) * 16 for i in range(24)]
        assert store.write(keys, list(blocks)) == [True] * 24
        per_node = []
        for node in cluster.nodes:
            with node.client() as r:
                per_node.append(r.dbsize())
        assert sum(per_node) == 24 and min(per_node) > 0
        targets = slots(24, 9)
        assert store.read(keys, list(targets)) == [ReadResult.HIT] * 24
        assert np.array_equal(targets, blocks)
        c.ping()
        assert store.delete(keys[:3]) == 3
        c.close()
    finally:
        cluster.cleanup()
