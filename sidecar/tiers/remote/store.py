"""The remote tier's values: one per block, named by namespace and block key.

Key: `<namespace>:<block key in hex>`. The block key is already salted by
the model, layout, dtype and TP size (`contract.blocks`), so sidecars of
different models share a store without colliding; the namespace separates
deployments (or tenants) that share one.

Value: a 32-byte header (magic, block size, key id, the block key), the
block's bytes, then its 32-byte MAC: HMAC-SHA256 under the deployment's
secret, or without one a checksum that catches accidents only
(`value_check`). The MAC comes last so that a large block is hashed piece by
piece right after the socket took each piece (`RemoteStore.value`). A value that is
absent, written under another key id (another secret, or none) or in
another format (its magic) is MISSING, and a lookup's probe does not count
it (`present`); one of the wrong size, under another
block key or whose bytes fail the MAC is CORRUPT: a miss either way, never
data. Reads receive each value straight into its slot and check it there,
as SSD reads do: a slot whose read is not a HIT may hold any bytes, and the
caller drops it (the slot of a block being staged is never visible before
its read succeeds).
"""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Sequence
from functools import partial
from typing import overload

import numpy as np

from shm.pool import buffer_view
from sidecar.tiers.remote.connector import Chunks, Connector, Later, Piece
from sidecar.tiers.remote.value_check import KEY_ID_BYTES, MAC_BYTES, MacStream, ValueCheck

HEAD = struct.Struct(f"<4sI{KEY_ID_BYTES}s")  # magic, block bytes, key id: what the MAC covers
FRONT = struct.Struct(f"<{HEAD.size}s16s")  # the above, the block key: before the block
FRONT_BYTES = FRONT.size  # 32
OVERHEAD_BYTES = FRONT_BYTES + MAC_BYTES  # 64: the MAC follows the block
MAGIC = b"KVR3"
"""Values of older formats are misses: KVR1 (a 32-byte header, an xxh3
checksum) has another size, so CORRUPT (deleted when read); KVR2 (the MAC
in a 64-byte header before the block) is MISSING, left in place until the
block is written again or the store evicts it."""


class ReadResult(enum.Enum):
    HIT = "hit"
    MISSING = "missing"
    """No value of ours under the key: never written, evicted by the store,
    lost in a restart, or written under another secret (or none)."""
    CORRUPT = "corrupt"
    """A value that fails its size, key or MAC."""


class RemoteStore:
    """Blocks of `block_bytes` in a remote store, through `connector`,
    checked by a MAC under `secret` (a checksum only, without one). Safe to
    call from several threads at once (the connector is)."""

    def __init__(
        self,
        connector: Connector,
        namespace: str,
        block_bytes: int,
        secret: bytes | None = None,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        self.connector = connector
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.check = ValueCheck(secret)
        self._head = HEAD.pack(MAGIC, block_bytes, self.check.key_id)
        self._pieces = _pieces(block_bytes) if block_bytes >= STREAM_MIN_BLOCK_BYTES else None
        self._prefix = namespace.encode() + b":"

    def name(self, key: bytes) -> bytes:
        """The store key of a 16-byte block key."""
        return self._prefix + key.hex().encode()

    def write(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[memoryview | np.ndarray],
        ttl: float | None = None,
    ) -> list[bool]:
        """Store each block (block_bytes of it, sent straight from its
        buffer) under its key; True where the store took it. With `ttl`, the
        store drops the values `ttl` seconds after it took them. A block of
        fewer bytes is refused before anything is sent."""
        names = [self.name(k) for k in keys]
        if len(blocks) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        short = next(
            (i for i, b in enumerate(blocks) if buffer_view(b).nbytes < self.block_bytes), None
        )
        if short is not None:
            raise ValueError(
                f"block {short} holds {buffer_view(blocks[short]).nbytes} bytes, "
                f"fewer than the {self.block_bytes} of a block"
            )
        ahead = (
            self._pieces is None
            and len(keys) > 1
            and len(keys) * self.block_bytes >= MACS_AHEAD_MIN_BYTES
        )
        values = _Values(self, names, keys, blocks, ahead)
        try:
            return self.connector.put(names, values, ttl)
        finally:
            values.close()

    def value(
        self, name: bytes, key: bytes, block: memoryview | np.ndarray, mac: bytes | None = None
    ) -> Chunks:
        """A block's value: its header, its bytes, then its MAC (`mac` where
        it was computed already). A block of STREAM_MIN_BLOCK_BYTES or more
        goes in pieces, each hashed once the connector has sent it."""
        data = self._data(block)
        front = FRONT.pack(self._head, key)
        if self._pieces is None or mac is not None:
            return (front, data, mac if mac is not None else self._mac(name, key, data))
        stream = self.check.start(name, self._head, key)
        out: list[Piece] = [front]
        for lo, hi in self._pieces:
            piece = data[lo:hi]
            last = hi == self.block_bytes
            out += (piece, Later(MAC_BYTES if last else 0, partial(_hashed, stream, piece, last)))
        return out

    def _data(self, block: memoryview | np.ndarray) -> memoryview:
        return buffer_view(block).cast("B")[: self.block_bytes]

    def _mac(self, name: bytes, key: bytes, data: memoryview) -> bytes:
        return self.check.digest(name, self._head, key, data)

    def read(
        self, keys: Sequence[bytes], targets: Sequence[memoryview | np.ndarray]
    ) -> list[ReadResult]:
        """Fetch each block into its target buffer (at least block_bytes);
        a target whose result is not HIT may hold any bytes."""
        fronts = [bytearray(FRONT_BYTES) for _ in keys]
        macs = [bytearray(MAC_BYTES) for _ in keys]
        bodies = [buffer_view(t).cast("B")[: self.block_bytes] for t in targets]
        got = self.connector.get_into(
            [self.name(k) for k in keys],
            [
                (memoryview(f), b, memoryview(m))
                for f, b, m in zip(fronts, bodies, macs, strict=True)
            ],
        )
        return [self._check(*args) for args in zip(keys, got, fronts, bodies, macs, strict=True)]

    def _check(
        self, key: bytes, got: bool | None, front: bytearray, body: memoryview, mac: bytearray
    ) -> ReadResult:
        if got is None:
            return ReadResult.MISSING
        if not got:  # a value of the wrong size
            return ReadResult.CORRUPT
        fields, stored_key = FRONT.unpack_from(front)
        magic, _, key_id = HEAD.unpack(fields)
        if magic != MAGIC or key_id != self.check.key_id:  # not ours to judge, nor to delete
            return ReadResult.MISSING
        if fields != self._head or stored_key != key:
            return ReadResult.CORRUPT
        if not self.check.verify(self.name(key), self._head, key, body, bytes(mac)):
            return ReadResult.CORRUPT
        return ReadResult.HIT

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each block has a value a read may find a HIT: its header
        (32 bytes, `GETRANGE`) is ours, for this block size and key. A value
        the reader takes as MISSING (another key id, an older format, not a
        string) stays in the store, and a probe that only asked whether the
        key exists found it again at every lookup: a hit that every load
        then failed. Only the MAC, checked by the read, can tell the rest."""
        heads = self.connector.heads([self.name(k) for k in keys], FRONT_BYTES)
        return [h == FRONT.pack(self._head, k) for k, h in zip(keys, heads, strict=True)]

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.connector.delete([self.name(k) for k in keys])


STREAM_MIN_BLOCK_BYTES = 1 << 20
PIECE_BYTES = 1 << 20
"""A block of STREAM_MIN_BLOCK_BYTES or more is sent in pieces of at most
PIECE_BYTES, each hashed right after the socket took it: the kernel's copy
has just brought it into the CPU's caches, and the server drains it while
the client hashes. Hashing a block before sending it read it from memory
once more, with the server idle (2 MiB blocks, docs/measurements.md#remote)."""

MACS_AHEAD_MIN_BYTES = 8 << 20
"""A write of smaller blocks, of at least this many bytes (and two blocks),
has its blocks' checksums or MACs computed on a thread of its own, in order,
while the connector sends the blocks before them (`_Values`)."""


def _pieces(block_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) of the pieces a block is sent in: as few as PIECE_BYTES
    allows, of equal size."""
    count = -(-block_bytes // PIECE_BYTES)
    size = -(-block_bytes // count)
    return [(lo, min(lo + size, block_bytes)) for lo in range(0, block_bytes, size)]


def _hashed(stream: MacStream, piece: memoryview, last: bool) -> bytes:
    stream.update(piece)
    return stream.finish() if last else b""


class _Values(Sequence[Chunks]):
    """The values of a write, each made when the connector packs its SET
    (`RedisConnector` sends them in groups, in order). A large block's
    value is sent in pieces and hashed as it goes (`RemoteStore.value`).

    Smaller blocks are hashed before they are sent. With `ahead`, a thread
    of the write's own computes their checksums (or MACs) in order, and a
    value waits for its block's: the sending thread then only sends (on
    loopback its core is saturated by the send and the kernel's receive
    path), 256 KiB blocks 0.93-1.08 of the floor ahead against 0.88-0.91
    inline (docs/measurements.md#remote). Without it, each checksum is
    computed right before its block is sent. `close()` stops the thread and
    waits for it: the blocks are the caller's again once `write` returns."""

    def __init__(
        self,
        store: RemoteStore,
        names: list[bytes],
        keys: Sequence[bytes],
        blocks: Sequence[memoryview | np.ndarray],
        ahead: bool = False,
    ) -> None:
        self._store, self._names, self._keys, self._blocks = store, names, keys, blocks
        self._macs: list[bytes] = []
        self._error: BaseException | None = None
        self._stop = False
        self._made = threading.Condition()
        self._thread: threading.Thread | None = None
        if ahead:
            self._thread = threading.Thread(target=self._compute, name="kvs-remote-macs")
            self._thread.start()

    def _compute(self) -> None:
        store = self._store
        try:
            for name, key, block in zip(self._names, self._keys, self._blocks, strict=True):
                if self._stop:
                    return
                mac = store._mac(name, key, store._data(block))
                with self._made:
                    self._macs.append(mac)
                    self._made.notify()
        except BaseException as err:  # handed to the sender, which raises it
            with self._made:
                self._error = err
                self._made.notify()

    def close(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._thread.join()
            self._thread = None

    def __len__(self) -> int:
        return len(self._names)

    @overload
    def __getitem__(self, i: int) -> Chunks: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Chunks]: ...
    def __getitem__(self, i: int | slice) -> Chunks | Sequence[Chunks]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("value index out of range")
        mac = None
        if self._thread is not None:
            with self._made:
                self._made.wait_for(lambda: len(self._macs) > i or self._error is not None)
                if len(self._macs) <= i:
                    assert self._error is not None
                    raise self._error
                mac = self._macs[i]
        return self._store.value(self._names[i], self._keys[i], self._blocks[i], mac)
