"""KV events: what an index reports about blocks becoming visible or going away.

The index queues them; its owner drains the queue (the sidecar publishes them
to the cluster router). The index itself does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.ids import BlockKey, BlockKeys


@dataclass(frozen=True)
class BlockStored:
    """`keys` became ready, as a run continuing from `parent` (None: from the root)."""

    keys: BlockKeys
    parent: BlockKey | None


@dataclass(frozen=True)
class BlockRemoved:
    """`keys` were evicted or deleted; each was previously reported stored."""

    keys: BlockKeys


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the index was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
