"""A large remote write computes its blocks' checksums (or MACs) on a thread
of its own, ahead of the sends (`sidecar.tiers.remote.store._Values`): the
values it writes are the ones an inline write makes, an error in the thread
reaches the caller, and no thread outlives the write."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from redis_servers import RedisClusterOf3

import sidecar.tiers.remote.store as store_mod
from sidecar.tiers.remote.connector import Chunks
from sidecar.tiers.remote.redis import RedisConnector
from sidecar.tiers.remote.store import ReadResult, RemoteStore
from sidecar.tiers.remote.value_check import ValueCheck

BLOCK = 64 << 10
SECRET = b"0123456789abcdef0123456789abcdef"


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(2, "little") * 8 for i in range(n)]


def helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvs-remote-macs"]


@pytest.fixture
def ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write of two blocks or more computes its MACs ahead."""
    monkeypatch.setattr(store_mod, "MACS_AHEAD_MIN_BYTES", 0)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["checksum", "mac"])
def test_values_made_ahead_are_those_made_inline(server, connector, monkeypatch, secret):
    n = 40
    src, k = blocks(n, 1), keys(n)
    store = RemoteStore(connector, "ns", BLOCK, secret=secret)
    written = {}
    for at_least in (0, 1 << 62):  # every write ahead, then none
        monkeypatch.setattr(store_mod, "MACS_AHEAD_MIN_BYTES", at_least)
        assert store.write(k, list(src)) == [True] * n
        with server.client() as r:
            written[at_least] = [r.get(store.name(key)) for key in k]
    assert written[0] == written[1 << 62]
    dst = blocks(n, 2)
    assert store.read(k, list(dst)) == [ReadResult.HIT] * n
    assert np.array_equal(dst, src)
    assert helpers() == []


def test_the_default_threshold_sends_a_large_write_ahead(connector, monkeypatch):
    started: list[int] = []
    real = store_mod._Values.__init__

    def spy(self, *args, **kwargs) -> None:
        real(self, *args, **kwargs)
        started.append(self._thread is not None)

    monkeypatch.setattr(store_mod._Values, "__init__", spy)
    store = RemoteStore(connector, "big", BLOCK)
    per_threshold = store_mod.MACS_AHEAD_MIN_BYTES // BLOCK
    assert store.write(keys(per_threshold), list(blocks(per_threshold, 3)))
    assert store.write(keys(per_threshold - 1), list(blocks(per_threshold - 1, 4)))
    assert started == [True, False]


def test_an_error_hashing_ahead_reaches_the_writer_and_leaves_no_thread(connector, ahead):
    store = RemoteStore(connector, "err", BLOCK)
    calls = 0

    def digest(name: bytes, head: bytes, key: bytes, block: memoryview) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("hashing failed")
        return ValueCheck(None).digest(name, head, key, block)

    store.check.digest = digest  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="hashing failed"):
        store.write(keys(12), list(blocks(12, 5)))
    assert helpers() == []


class _FailsAfterOne:
    """A connector whose store goes away after the first value is packed."""

    def __init__(self) -> None:
        self.packed = 0

    def put(self, names: Sequence[bytes], values: Sequence[Chunks], ttl=None) -> list[bool]:
        values[0]
        self.packed += 1
        raise ConnectionError("the store went away")


def test_a_failed_send_stops_the_thread_before_the_write_returns(ahead):
    connector = _FailsAfterOne()
    store = RemoteStore(connector, "gone", BLOCK)  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        store.write(keys(64), list(blocks(64, 6)))
    assert connector.packed == 1
    assert helpers() == []


def test_values_are_indexed_as_a_sequence_is(connector, ahead):
    src = blocks(3, 7)
    store = RemoteStore(connector, "idx", BLOCK)
    values = store_mod._Values(store, [store.name(k) for k in keys(3)], keys(3), list(src), True)
    try:
        assert values[-1] == values[2]
        assert [v[0] for v in values[0:2]] == [values[0][0], values[1][0]]
        with pytest.raises(IndexError):
            values[3]
    finally:
        values.close()
    assert helpers() == []


def test_a_write_of_no_blocks_is_still_nothing(connector: RedisConnector, ahead):
    assert RemoteStore(connector, "none", BLOCK).write([], []) == []


def test_a_cluster_takes_the_values_out_of_order_and_gets_each_its_own(redis_bin, ahead):
    """A cluster's connector packs each node's keys in turn: values are asked
    for out of the order the thread makes them in."""
    cluster = RedisClusterOf3().start()
    try:
        c = RedisConnector(cluster.url, timeout=5.0, cluster=True)
        n = 30
        src, k = blocks(n, 8), keys(n)
        store = RemoteStore(c, "kv", BLOCK, secret=SECRET)
        assert store.write(k, list(src)) == [True] * n
        per_node = cluster.keys_per_node()
        assert sum(per_node) == n and sum(x > 0 for x in per_node) >= 2, per_node
        dst = blocks(n, 9)
        assert store.read(k, list(dst)) == [ReadResult.HIT] * n
        assert np.array_equal(dst, src)
        assert helpers() == []
        c.close()
    finally:
        cluster.cleanup()
