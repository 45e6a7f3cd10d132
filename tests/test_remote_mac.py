"""The remote tier's values are checked by a MAC keyed with the deployment's
secret: a value forged by anyone who can write to the store, but has not the
secret, is a miss and never reaches an engine. Against real Redis servers."""

from __future__ import annotations

import struct

import numpy as np
import xxhash
from sidecar_proc import Sidecar, tokens, wait_for
from test_sidecar_remote import BLOCK_TOKENS, blocks_of, client, kv, remote, settled

from sidecar.tiers.remote.redis import RedisConnector
from sidecar.tiers.remote.store import FRONT_BYTES, OVERHEAD_BYTES, ReadResult, RemoteStore

BLOCK = 64 << 10
SECRET = b"0123456789abcdef0123456789abcdef"


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 16 for i in range(n)]


def test_keyed_values_round_trip_byte_exact(connector):
    store = RemoteStore(connector, "ns", BLOCK, secret=SECRET)
    src = blocks(4, 1)
    assert store.write(keys(4), list(src)) == [True] * 4
    dst = blocks(4, 2)
    assert store.read(keys(4), list(dst)) == [ReadResult.HIT] * 4
    assert np.array_equal(dst, src)


def test_values_forged_without_the_secret_are_misses(server, connector):
    store = RemoteStore(connector, "ns", BLOCK, secret=SECRET)
    k = keys(4)
    store.write(k, list(blocks(4, 1)))
    forged = blocks(4, 9)
    # What an attacker with write access but no secret can do: write with the
    # public code (no secret, or a guessed one), or keep a real value's header
    # and MAC and swap the bytes; or the old value formats.
    RemoteStore(connector, "ns", BLOCK).write([k[0]], [forged[0]])
    RemoteStore(connector, "ns", BLOCK, secret=b"guessed" * 4).write([k[1]], [forged[1]])
    with server.client() as r:
        real = r.get(store.name(k[2]))
        r.set(store.name(k[2]), real[:FRONT_BYTES] + forged[2].tobytes() + real[-32:])
        seed = int.from_bytes(k[3][:8], "little")
        digest = xxhash.xxh3_64(forged[3], seed=seed).intdigest()
        old = struct.pack("<4sIQ16s", b"KVR1", BLOCK, digest, k[3])
        r.set(store.name(k[3]), old + forged[3].tobytes() + bytes(OVERHEAD_BYTES - len(old)))
    results = store.read(k, list(blocks(4, 3)))
    assert ReadResult.HIT not in results


def test_keyed_values_are_misses_without_the_secret(connector):
    RemoteStore(connector, "ns", BLOCK, secret=SECRET).write(keys(1), list(blocks(1, 1)))
    assert RemoteStore(connector, "ns", BLOCK).read(keys(1), list(blocks(1, 2))) != [ReadResult.HIT]


def test_a_sidecar_never_loads_a_forged_value(tmp_path, server):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    args = ("--set", f"remote_url={server.url}", "--set", f"remote_secret_file={secret_file}")
    a, b, c = Sidecar(*args), Sidecar(*args), Sidecar(*args)
    try:
        src = kv(1)
        with client(a.start(), src) as e:
            assert e.save(tokens(4), np.arange(4)).wait() == 4 * BLOCK_TOKENS
            wait_for(lambda: remote(e)["cached_blocks"] == 4 and settled(e))
        dst = kv(None)
        with client(b.start(), dst) as e:  # same secret: shared byte-exact
            assert e.load(tokens(4), np.arange(10, 14)).wait() == 4 * BLOCK_TOKENS
            assert blocks_of(dst, np.arange(10, 14)) == blocks_of(src, np.arange(4))
        with server.client() as r:  # an attacker rewrites every value
            names = r.keys("kvsidecar:*")
            assert len(names) == 4
            size = len(r.get(names[0])) - OVERHEAD_BYTES
        conn = RedisConnector(server.url, timeout=2.0)
        forger = RemoteStore(conn, "kvsidecar", size)
        forged = np.full((len(names), size), 7, dtype=np.uint8)
        assert forger.write([bytes.fromhex(n.decode().split(":")[1]) for n in names], list(forged))
        conn.close()
        dst = kv(None)
        with client(c.start(), dst) as e:
            assert e.lookup(tokens(4)) == 0  # a probe reads the headers: not ours
            assert remote(e)["found_blocks"] == 0
            assert e.load(tokens(4), np.arange(10, 14)).wait() == 0  # the engine recomputes
            assert blocks_of(dst, np.arange(10, 14)) == blocks_of(kv(None), np.arange(4))
            assert e.stats()["hits"]["hit_blocks"]["remote"] == 0
        for s in (a, b, c):
            assert s.stop() == 0
    finally:
        for s in (a, b, c):
            s.cleanup()


def test_no_secret_is_warned_about_at_start(server):
    s = Sidecar("--set", f"remote_url={server.url}")
    try:
        s.start()
        assert s.proc is not None and s.proc.stderr is not None
        s.proc.terminate()
        s.proc.wait(15)
        log = "".join(s.early) + s.proc.stderr.read()
        assert "WARNING" in log and "remote_secret_file" in log and "fully trusted" in log
    finally:
        s.cleanup()
