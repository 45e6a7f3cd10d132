"""A plan (one GET, PUT or write-back) and the bookkeeping of its life."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sidecar.control.graph import TransferGraph

if TYPE_CHECKING:
    from sidecar.control.cache_engine import CacheEngine
    from sidecar.control.node import RadixNode


class PlanError(ValueError):
    """A completion, failure or cancel that does not fit the plan; nothing changed."""


class PlanKind(enum.Enum):
    GET = "get"
    PUT = "put"
    WRITE_BACK = "write_back"


class TierCounts(NamedTuple):
    cpu: int = 0
    ssd: int = 0
    remote: int = 0

    @property
    def total(self) -> int:
        return self.cpu + self.ssd + self.remote


@dataclass(frozen=True)
class Plan:
    """What the engine and the sidecar's pools must do, as a TransferGraph.

    GET: `hit_blocks` counts blocks the GPU receives from each tier; they are
    blocks [skip, skip + hit_blocks.total) of the request. PUT: the CPU tier
    stores `stored_blocks` new blocks after the `skipped_blocks` it had.
    A plan with no ops is finished when it is returned.
    """

    plan_id: int
    kind: PlanKind
    graph: TransferGraph
    hit_blocks: TierCounts = field(default_factory=TierCounts)
    skipped_blocks: int = 0
    stored_blocks: int = 0
    in_flight_blocks: int = 0
    """PUT: blocks past the skipped ones that another plan is saving right now."""

    @property
    def finished_on_return(self) -> bool:
        return not self.graph.ops


@dataclass
class ReadyWait:
    """`node` of `engine` becomes ready once every op in `ops` is done; all
    of it but its last `keep` blocks, if `keep` (a staging made ready part
    by part: `RadixIndex.set_ready_front`)."""

    engine: CacheEngine
    node: RadixNode
    ops: set[int]
    keep: int = 0


@dataclass
class RunningPlan:
    """What a plan in flight holds, so that finishing or rolling it back
    releases exactly that: locks, unready inserts, and slots kept for it."""

    plan: Plan
    done: set[int] = field(default_factory=set)
    locks: list[tuple[CacheEngine, RadixNode]] = field(default_factory=list)
    inserted: list[tuple[CacheEngine, RadixNode]] = field(default_factory=list)
    waits: list[ReadyWait] = field(default_factory=list)
    held: list[tuple[CacheEngine, np.ndarray]] = field(default_factory=list)

    def lock(self, engine: CacheEngine, node: RadixNode | None) -> None:
        if node is not None:
            engine.lock(node)
            self.locks.append((engine, node))

    def mark_done(self, op_id: int) -> None:
        """Record op_id as done and make ready every node that waited only on it."""
        self.done.add(op_id)
        for wait in self.waits:
            if op_id in wait.ops:
                wait.ops.discard(op_id)
                if not wait.ops:
                    if wait.keep:
                        wait.engine.set_ready_front(wait.node, wait.keep)
                    else:
                        wait.engine.set_ready(wait.node)

    def release(self) -> None:
        """Unlock, drop what never landed, free kept slots. Ends the plan."""
        for engine, node in reversed(self.locks):
            engine.unlock(node)
        for engine, node in self.inserted:
            if not node.ready:
                engine.discard(node)
        for engine, slots in self.held:
            engine.free(slots)
        self.locks.clear()
        self.inserted.clear()
        self.held.clear()
