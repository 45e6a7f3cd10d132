"""The remote tier's values: one per block, named by namespace and block key.

Key: `<namespace>:<block key in hex>`. The block key is already salted by
the model, layout, dtype and TP size (`contract.blocks`), so sidecars of
different models share a store without colliding; the namespace separates
deployments (or tenants) that share one.

Value: a 64-byte header (magic, block size, key id, MAC, the block key
itself) followed by the block's bytes. The MAC is HMAC-SHA256 under the
deployment's secret, or without one a checksum that catches accidents only
(`value_check`). A value that is absent, written under another key id
(another secret, or none) or in another format (its magic) is MISSING; one
of the wrong size, under another block key or whose bytes fail the MAC is
CORRUPT: a miss either way, never data. Reads receive each value straight into
its slot and check it there, as SSD reads do: a slot whose read is not a
HIT may hold any bytes, and the caller drops it (the slot of a block being
staged is never visible before its read succeeds).
"""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Sequence
from typing import overload

import numpy as np

from sidecar.tiers.remote.connector import Chunks, Connector
from sidecar.tiers.remote.value_check import KEY_ID_BYTES, MAC_BYTES, ValueCheck

HEAD = struct.Struct(f"<4sI{KEY_ID_BYTES}s")  # magic, block bytes, key id: what the MAC covers
HEADER = struct.Struct(f"<{HEAD.size}s{MAC_BYTES}s16s")  # the above, MAC, block key
HEADER_BYTES = HEADER.size  # 64
MAGIC = b"KVR2"
"""Values of the KVR1 format (a 32-byte header, an xxh3 checksum) have another
size: CORRUPT, so a miss, deleted when read."""


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
        self._prefix = namespace.encode() + b":"

    def name(self, key: bytes) -> bytes:
        """The store key of a 16-byte block key."""
        return self._prefix + key.hex().encode()

    def write(self, keys: Sequence[bytes], blocks: Sequence[memoryview | np.ndarray]) -> list[bool]:
        """Store each block (block_bytes of it, sent straight from its
        buffer) under its key; True where the store took it."""
        names = [self.name(k) for k in keys]
        if len(blocks) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        ahead = len(keys) > 1 and len(keys) * self.block_bytes >= MACS_AHEAD_MIN_BYTES
        values = _Values(self, names, keys, blocks, ahead)
        try:
            return self.connector.put(names, values)
        finally:
            values.close()

    def value(
        self, name: bytes, key: bytes, block: memoryview | np.ndarray, mac: bytes | None = None
    ) -> Chunks:
        """A block's value: its header (with the checksum or MAC: `mac`
        where it was computed already), then its bytes."""
        data = self._data(block)
        if mac is None:
            mac = self._mac(name, key, data)
        return (HEADER.pack(self._head, mac, key), data)

    def _data(self, block: memoryview | np.ndarray) -> memoryview:
        return memoryview(block).cast("B")[: self.block_bytes]

    def _mac(self, name: bytes, key: bytes, data: memoryview) -> bytes:
        return self.check.digest(name, self._head, key, data)

    def read(
        self, keys: Sequence[bytes], targets: Sequence[memoryview | np.ndarray]
    ) -> list[ReadResult]:
        """Fetch each block into its target buffer (at least block_bytes);
        a target whose result is not HIT may hold any bytes."""
        heads = [bytearray(HEADER_BYTES) for _ in keys]
        bodies = [memoryview(t).cast("B")[: self.block_bytes] for t in targets]
        got = self.connector.get_into(
            [self.name(k) for k in keys],
            [(memoryview(h), b) for h, b in zip(heads, bodies, strict=True)],
        )
        return [self._check(*args) for args in zip(keys, got, heads, bodies, strict=True)]

    def _check(self, key: bytes, got: bool | None, head: bytearray, body: memoryview) -> ReadResult:
        if got is None:
            return ReadResult.MISSING
        if not got:  # a value of the wrong size
            return ReadResult.CORRUPT
        fields, mac, stored_key = HEADER.unpack_from(head)
        magic, _, key_id = HEAD.unpack(fields)
        if magic != MAGIC or key_id != self.check.key_id:  # not ours to judge, nor to delete
            return ReadResult.MISSING
        if fields != self._head or stored_key != key:
            return ReadResult.CORRUPT
        if not self.check.verify(self.name(key), self._head, key, body, mac):
            return ReadResult.CORRUPT
        return ReadResult.HIT

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.connector.exists([self.name(k) for k in keys])

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.connector.delete([self.name(k) for k in keys])


MACS_AHEAD_MIN_BYTES = 8 << 20
"""A write of at least this many bytes (and two blocks) has its blocks'
checksums or MACs computed on a thread of its own, in order, while the
connector sends the blocks before them (`_Values`)."""


class _Values(Sequence[Chunks]):
    """The values of a write, each made when the connector packs its SET
    (`RedisConnector` sends them in groups, in order).

    With `ahead`, a thread of the write's own computes the blocks' checksums
    (or MACs) in order, and a value waits for its block's. The sending
    thread then only sends: on loopback its core is saturated by the send
    (and the kernel's receive path), and the checksum, one more pass over
    the block, came on top of it. 2 MiB blocks, 256 MiB a write, a slow-
    memory hour: 2.46-2.55 GB/s hashing inline, 2.81-2.96 ahead
    (docs/measurements.md#remote). Without it, each checksum is computed
    right before its block is sent, while the block is in the CPU's caches.
    `close()` stops the thread and waits for it: the blocks are the
    caller's again once `write` returns."""

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
