"""A remote value is its header, its block, then its MAC; a block of 1 MiB or
more goes to the socket in pieces, each hashed once it has been sent
(`RemoteStore.value`, `Later`). Against real redis-server processes: the
stored bytes are the ones the format defines, whatever the path, and an older
format is never read as data."""

from __future__ import annotations

import hmac
import itertools
import struct

import numpy as np
import pytest
import xxhash
from redis_servers import RedisClusterOf3

import sidecar.tiers.remote.redis as redis_mod
import sidecar.tiers.remote.store as store_mod
from sidecar.tiers.remote.connector import Later
from sidecar.tiers.remote.redis import RedisConnector
from sidecar.tiers.remote.store import (
    FRONT_BYTES,
    OVERHEAD_BYTES,
    ReadResult,
    RemoteStore,
    _pieces,
)

SECRET = b"0123456789abcdef0123456789abcdef"
MIB = 1 << 20


def blocks(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def keys(n: int) -> list[bytes]:
    return [(i + 1).to_bytes(2, "little") * 8 for i in range(n)]


def expected_value(store: RemoteStore, key: bytes, block: np.ndarray, secret: bytes | None):
    """The value as the format defines it, computed here from its parts."""
    size = block.nbytes
    key_id = (
        bytes(8)
        if secret is None
        else hmac.digest(secret, b"kvsidecar remote value key id v1", "sha256")[:8]
    )
    head = struct.pack("<4sI8s", b"KVR3", size, key_id)
    if secret is None:
        seed = int.from_bytes(key[:8], "little")
        mac = xxhash.xxh3_64(block.tobytes(), seed=seed).intdigest().to_bytes(8, "little") + bytes(
            24
        )
    else:
        name = store.name(key)
        mac = hmac.digest(
            secret, len(name).to_bytes(4, "little") + name + head + block.tobytes(), "sha256"
        )
    return head + key + block.tobytes() + mac


@pytest.mark.parametrize("secret", [None, SECRET], ids=["checksum", "mac"])
@pytest.mark.parametrize(
    "size", [64 << 10, MIB, 3 * MIB + 4096], ids=["64KiB", "1MiB", "3MiB+4KiB"]
)
def test_stored_values_are_the_format_whatever_the_path(server, connector, secret, size):
    n = 5
    src, k = blocks(n, size, size), keys(n)
    store = RemoteStore(connector, "ns", size, secret=secret)
    assert (store._pieces is not None) == (size >= store_mod.STREAM_MIN_BLOCK_BYTES)
    assert store.write(k, list(src)) == [True] * n
    with server.client() as r:
        for key, block in zip(k, src, strict=True):
            assert r.get(store.name(key)) == expected_value(store, key, block, secret)
    dst = blocks(n, size, size + 1)
    assert store.read(k, list(dst)) == [ReadResult.HIT] * n
    assert np.array_equal(dst, src)


def test_pieces_cover_a_block_in_equal_parts_of_at_most_a_piece():
    assert _pieces(2 * MIB) == [(0, MIB), (MIB, 2 * MIB)]
    assert _pieces(MIB) == [(0, MIB)]
    assert _pieces(3 * MIB // 2) == [(0, 3 * MIB // 4), (3 * MIB // 4, 3 * MIB // 2)]
    for size in (MIB + 1, 5 * MIB - 7, 7 * MIB):
        parts = _pieces(size)
        assert parts[0][0] == 0 and parts[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
        assert all(0 < hi - lo <= store_mod.PIECE_BYTES for lo, hi in parts)
        assert len(parts) == -(-size // store_mod.PIECE_BYTES)


def test_each_piece_is_hashed_after_the_socket_took_it(connector, monkeypatch):
    """Every Later is made after all the bytes before it were sent."""
    sent = 0
    real_send = redis_mod._send

    def counting(conn, chunks) -> None:
        nonlocal sent
        real_send(conn, chunks)
        sent += sum(memoryview(c).nbytes for c in chunks)

    monkeypatch.setattr(redis_mod, "_send", counting)
    made_at: list[tuple[int, int]] = []
    store = RemoteStore(connector, "order", 2 * MIB)
    value = store.value
    before = 0

    def watched(name, key, block, mac=None):
        nonlocal before
        out = []
        for piece in value(name, key, block, mac):
            if isinstance(piece, Later):
                piece = Later(
                    piece.size, lambda p=piece, b=before: (made_at.append((sent, b)), p.make())[1]
                )
            else:
                before += memoryview(piece).nbytes
            out.append(piece)
        return out

    monkeypatch.setattr(store, "value", watched)
    assert store.write(keys(3), list(blocks(3, 2 * MIB, 1))) == [True] * 3
    assert len(made_at) == 6  # two pieces a block
    # `before` counts value bytes only; the sent bytes add the SET commands.
    assert all(sent_then >= value_bytes for sent_then, value_bytes in made_at)


def test_a_later_piece_of_the_wrong_size_fails_the_write_and_its_connection(server, connector):
    bad = [b"head", b"x" * 100, Later(8, lambda: b"short")]
    with pytest.raises(ValueError, match="Later piece of 8 bytes made 5"):
        connector.put([b"bad"], [bad])
    assert connector.put([b"good"], [[b"ok", Later(3, lambda: b"!!!")]]) == [True]
    with server.client() as r:
        assert r.get(b"bad") is None
        assert r.get(b"good") == b"ok!!!"


def test_values_of_the_older_formats_are_misses(server, connector):
    size = 2 * MIB
    store = RemoteStore(connector, "old", size)
    k, src = keys(2), blocks(2, size, 4)
    seed = int.from_bytes(k[0][:8], "little")
    digest = xxhash.xxh3_64(src[0].tobytes(), seed=seed).intdigest()
    kvr2 = (
        struct.pack("<4sI8s", b"KVR2", size, bytes(8))
        + digest.to_bytes(8, "little")
        + bytes(24)
        + k[0]
    )
    kvr1 = struct.pack("<4sIQ16s", b"KVR1", size, digest, k[1])
    with server.client() as r:
        r.set(store.name(k[0]), kvr2 + src[0].tobytes())
        r.set(store.name(k[1]), kvr1 + src[1].tobytes())
    assert len(kvr2) == OVERHEAD_BYTES and FRONT_BYTES == 32
    assert store.read(k, list(blocks(2, size, 5))) == [ReadResult.MISSING, ReadResult.CORRUPT]
    with server.client() as r:
        assert r.exists(store.name(k[0]))  # not ours to judge: left in place


def test_a_cluster_gets_streamed_values_node_by_node(redis_bin):
    cluster = RedisClusterOf3().start()
    try:
        c = RedisConnector(cluster.url, timeout=10.0, cluster=True)
        n, size = 8, 2 * MIB
        src, k = blocks(n, size, 8), keys(n)
        store = RemoteStore(c, "kv", size, secret=SECRET)
        assert store.write(k, list(src)) == [True] * n
        per_node = cluster.keys_per_node()
        assert sum(per_node) == n and sum(x > 0 for x in per_node) >= 2, per_node
        dst = blocks(n, size, 9)
        assert store.read(k, list(dst)) == [ReadResult.HIT] * n
        assert np.array_equal(dst, src)
        c.close()
    finally:
        cluster.cleanup()


def test_the_smallest_connector_stores_streamed_values_too():
    """`Later` is part of the connector contract: a connector written
    against it alone (a dict) holds the same values as Redis does."""
    from test_redis_connector import _DictConnector

    size = 2 * MIB
    plain = _DictConnector()
    store = RemoteStore(plain, "ns", size)
    src, k = blocks(2, size, 11), keys(2)
    assert store.write(k, list(src)) == [True, True]
    for key, block in zip(k, src, strict=True):
        assert plain.values[store.name(key)] == expected_value(store, key, block, None)
    dst = blocks(2, size, 12)
    assert store.read(k, list(dst)) == [ReadResult.HIT, ReadResult.HIT]
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("size", [64 << 10, 2 * MIB], ids=["grouped", "streamed"])
def test_a_short_block_is_refused_before_anything_is_sent(server, connector, size):
    store = RemoteStore(connector, "short", size)
    src = blocks(3, size, 13)
    with pytest.raises(ValueError, match=f"block 2 holds {size - 1} bytes"):
        store.write(keys(3), [src[0], src[1], src[2][:-1]])
    with server.client() as r:
        assert r.dbsize() == 0
    assert store.write(keys(3), list(src)) == [True] * 3  # the connection is still good
