"""The remote tier's values: one per block, named by namespace and block key.

Key: `<namespace>:<block key in hex>`. The block key is already salted by
the model, layout, dtype and TP size (`contract.blocks`), so sidecars of
different models share a store without colliding; the namespace separates
deployments (or tenants) that share one.

Value: a 32-byte header (magic, block size, xxh3-64 checksum seeded by the
block key, the block key itself) followed by the block's bytes. A value
that is absent, of the wrong size, under another key or whose bytes fail
the checksum is a miss, never data. Reads receive each value straight into
its slot and check it there, as SSD reads do: a slot whose read is not a
HIT may hold any bytes, and the caller drops it (the slot of a block being
staged is never visible before its read succeeds).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import numpy as np

from sidecar.tiers.remote.connector import Connector
from sidecar.tiers.ssd.store import checksum

HEADER = struct.Struct("<4sIQ16s")  # magic, block bytes, checksum, block key
HEADER_BYTES = HEADER.size  # 32
MAGIC = b"KVR1"


class ReadResult(enum.Enum):
    HIT = "hit"
    MISSING = "missing"
    """No value under the key (never written, evicted by the store, or lost
    in a restart)."""
    CORRUPT = "corrupt"
    """A value that fails its size, key or checksum."""


class RemoteStore:
    """Blocks of `block_bytes` in a remote store, through `connector`.
    Safe to call from several threads at once (the connector is)."""

    def __init__(self, connector: Connector, namespace: str, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        self.connector = connector
        self.namespace = namespace
        self.block_bytes = block_bytes
        self._prefix = namespace.encode() + b":"

    def name(self, key: bytes) -> bytes:
        """The store key of a 16-byte block key."""
        return self._prefix + key.hex().encode()

    def write(self, keys: Sequence[bytes], blocks: Sequence[memoryview | np.ndarray]) -> list[bool]:
        """Store each block (block_bytes of it, sent straight from its
        buffer) under its key; True where the store took it."""
        values = []
        for key, block in zip(keys, blocks, strict=True):
            data = memoryview(block).cast("B")[: self.block_bytes]
            head = HEADER.pack(MAGIC, self.block_bytes, checksum(data, key), key)
            values.append((head, data))
        return self.connector.put([self.name(k) for k in keys], values)

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
        magic, size, digest, stored_key = HEADER.unpack_from(head)
        if magic != MAGIC or size != self.block_bytes or stored_key != key:
            return ReadResult.CORRUPT
        if checksum(body, key) != digest:
            return ReadResult.CORRUPT
        return ReadResult.HIT

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.connector.exists([self.name(k) for k in keys])

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.connector.delete([self.name(k) for k in keys])
