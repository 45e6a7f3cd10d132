"""Typed ids of the control plane.

A block key, a tier slot and a GPU block id are all small integers or byte
strings underneath; distinct types keep them from being mixed up silently.

Keys are 128-bit chained hashes (see `contract.blocks`). One key is 16 bytes;
a run of keys is a numpy array of dtype `KEY_DTYPE` (16-byte void), compared
through a flat uint64 view, which is ~8x faster than comparing void items.
"""

from __future__ import annotations

from typing import NewType

import numpy as np

KEY_BYTES = 16
KEY_DTYPE = np.dtype((np.void, KEY_BYTES))
SLOT_DTYPE = np.dtype(np.int64)

BlockKey = NewType("BlockKey", bytes)
"""One 16-byte block key, as used for dict lookups."""

BlockKeys = NewType("BlockKeys", np.ndarray)
"""A run of block keys: shape (n,), dtype KEY_DTYPE."""

SlotIds = NewType("SlotIds", np.ndarray)
"""Slots of one tier's mempool: shape (n,), dtype int64."""

GpuBlockIds = NewType("GpuBlockIds", np.ndarray)
"""An engine's own paged-KV block ids: shape (n,), dtype int64."""


def as_keys(data: bytes | bytearray | memoryview | np.ndarray) -> BlockKeys:
    """View raw key bytes (a multiple of 16) or a KEY_DTYPE array as BlockKeys."""
    if isinstance(data, bytes):  # the common case, in one numpy call
        if len(data) % KEY_BYTES == 0:
            return BlockKeys(np.frombuffer(data, dtype=KEY_DTYPE))
    elif isinstance(data, np.ndarray):
        if data.dtype == KEY_DTYPE and data.ndim == 1:
            return BlockKeys(data)
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if arr.size % KEY_BYTES:
        raise ValueError(f"key bytes must be a multiple of {KEY_BYTES}, got {arr.size}")
    return BlockKeys(arr.view(KEY_DTYPE))


def key_bytes(keys: BlockKeys) -> bytes:
    """The keys back to back: the bytes object they view, when they view all
    of one in order (keys from a message frame or a KeyHasher: no copy), or
    a copy."""
    base: object = keys.base  # numpy's stubs say ndarray | None; frombuffer leaves the bytes
    if type(base) is bytes and len(base) == keys.nbytes and keys.flags.c_contiguous:
        return base
    return keys.tobytes()


def keys_from_ints(values: np.ndarray | list[int], high: int = 0) -> BlockKeys:
    """Build keys from integers (< 2**64), with `high` as the upper 64 bits.

    For traces and tests whose blocks are already identified by integers;
    production keys come from `contract.blocks`.
    """
    low = np.asarray(values, dtype=np.uint64)
    pairs = np.empty((low.size, 2), dtype=np.uint64)
    pairs[:, 0] = low
    pairs[:, 1] = high
    return BlockKeys(pairs.reshape(-1).view(KEY_DTYPE))


def key_at(keys: BlockKeys, i: int) -> BlockKey:
    """The i-th key as hashable bytes."""
    return BlockKey(keys[i].tobytes())


def as_slots(values: np.ndarray | list[int]) -> SlotIds:
    return SlotIds(np.asarray(values, dtype=SLOT_DTYPE))


def as_gpu_blocks(values: np.ndarray | list[int]) -> GpuBlockIds:
    return GpuBlockIds(np.asarray(values, dtype=np.int64))


def split_keys(raw: bytes) -> list[BlockKey]:
    """Concatenated 16-byte keys -> one BlockKey each. Raises ValueError on a
    length that is not a multiple of 16."""
    if len(raw) % KEY_BYTES:
        raise ValueError(f"key bytes must be a multiple of {KEY_BYTES}, got {len(raw)}")
    return [BlockKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]
