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
    """Offer engine blocks `block_ids` (a request's full blocks from its
    first on, the last `new_blocks` of them completed by this step's
    forward) under `keys`. The sidecar skips the blocks it has or is being
    sent already, so earlier blocks cost a key each, not a copy."""

    req_id: str
    keys: BlockKeys
    block_ids: np.ndarray
    new_blocks: int

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids) or len(self.keys) == 0:
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} block ids")
        if not 0 < self.new_blocks <= len(self.keys):
            raise ValueError(f"new_blocks {self.new_blocks} of {len(self.keys)}")


@dataclass(frozen=True)
class ConnectorMeta:
    """One step's work for every worker (vLLM's KVConnectorMetadata role).

    Workers run `saves` after the step's forward, in order, on a thread of
    their own; a request in `finished` is reported finished sending (vLLM
    may free its blocks) once every save offered for it before is done."""

    step: int = 0
    """The scheduler's step count: TP ranks name the plans they share by it."""
    loads: tuple[LoadSpec, ...] = field(default=())
    saves: tuple[SaveSpec, ...] = field(default=())
    finished: tuple[str, ...] = field(default=())
    """Requests vLLM keeps the blocks of (request_finished returned True)."""
    preempted: tuple[str, ...] = field(default=())
    """Requests whose blocks vLLM freed: their saves must land before this
    step's forward may overwrite the blocks (handle_preemptions)."""
