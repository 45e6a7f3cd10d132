"""Block keys and engine block ids as an engine hands them to `KVClient`,
checked before they reach the sidecar."""

from __future__ import annotations

from typing import Any

import numpy as np

from contract.ids import KEY_BYTES, KEY_DTYPE, BlockKeys


def checked_keys(keys: Any) -> BlockKeys:
    """Keys as made by `block_keys` / `digest_keys`; TypeError for anything else."""
    if not isinstance(keys, np.ndarray) or keys.dtype != KEY_DTYPE or keys.ndim != 1:
        raise TypeError(
            f"keys must be a 1-D array of {KEY_BYTES}-byte block keys from block_keys() or "
            f"digest_keys(), got {type(keys).__name__} {getattr(keys, 'dtype', '')}"
        )
    return BlockKeys(keys)


def keys_and_blocks(keys: Any, block_ids: Any) -> tuple[BlockKeys, np.ndarray]:
    """`keys` checked, and the engine block ids of those blocks (the first
    of `block_ids`, as int64). TypeError unless `block_ids` is 1-D integers,
    ValueError if there are fewer of them than keys."""
    keys = checked_keys(keys)
    blocks = np.asarray(block_ids)
    if blocks.ndim != 1 or (blocks.size and blocks.dtype.kind not in "iu"):
        raise TypeError("block_ids must be a 1-D sequence of integers")
    if blocks.size < len(keys):
        raise ValueError(f"{len(keys)} full blocks of tokens but {blocks.size} block ids")
    return keys, blocks[: len(keys)].astype(np.int64)
