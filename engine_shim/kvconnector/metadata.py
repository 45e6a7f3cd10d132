"""What the scheduler side tells every worker each step. Plain frozen
dataclasses of numpy arrays and ints, so they pickle across processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contract.ids import BlockKeys


@dataclass(frozen=True)
class LoadSpec:
    """Load the cached blocks `keys[skip_blocks:]` into engine blocks
    `block_ids[skip_blocks:]`; the first `skip_blocks` are computed already."""

    req_id: str
    keys: BlockKeys
    block_ids: np.ndarray
    """int64, one per key."""
    skip_blocks: int

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys but {len(self.block_ids)} block ids")
        if not 0 <= self.skip_blocks < len(self.keys):
            raise ValueError(f"skip_blocks {self.skip_blocks} leaves nothing of {len(self.keys)}")

    @property
    def num_blocks(self) -> int:
        """Blocks in the engine's cache once the load is done: skipped ones too."""
        return len(self.keys)


@dataclass(frozen=True)
class SaveSpec:
    """Offer engine blocks `block_ids` (the full blocks of a finished
    request, kept alive until the save is reported) under `keys`."""

    req_id: str
    keys: BlockKeys
    block_ids: np.ndarray

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids) or len(self.keys) == 0:
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} block ids")


@dataclass(frozen=True)
class ConnectorMeta:
    """One step's work for every worker (vLLM's KVConnectorMetadata role)."""

    loads: tuple[LoadSpec, ...] = field(default=())
    saves: tuple[SaveSpec, ...] = field(default=())
