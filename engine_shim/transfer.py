"""The engine side of a plan: this rank's copies, and the handle of a load
or save in flight.

A plan names, per op, engine block ids and shared-memory slots; this rank
copies its shard of each op with the copier of its registration (cuda_ext),
and `KVClient` tells the sidecar how the copies went. The sidecar may reuse
a plan's slots once told, so nothing is reported before the copies have
landed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from contract.ops import OpKind
from shm.layout import BlockLayout


class EngineOp(NamedTuple):
    """One op of a plan that the engine runs: copy src[i] to dst[i] for
    every i (H2D: shm slots to engine blocks; D2H: the other way)."""

    op_id: int
    kind: OpKind
    src: np.ndarray
    dst: np.ndarray


@dataclass(frozen=True)
class PlanOps:
    """The engine side of a plan: what every TP rank copies. Picklable, so a
    TP leader can hand it to the other ranks (see `KVClient.execute`)."""

    plan_id: int
    kind: str
    """"load" or "save"."""
    ops: tuple[EngineOp, ...]
    boot_id: str
    """The sidecar boot that made the plan: its slots mean nothing to another."""


class Copy(Protocol):
    """A queued copy (cuda_ext: a GPU copy's events, or one already done)."""

    def query(self) -> bool:
        """Whether it has landed."""
        ...

    def synchronize(self) -> None:
        """Block until it has landed; raises its error."""
        ...

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make `stream` wait until model layer `layer` has landed."""
        ...


class Copier(Protocol):
    """Copies between one rank's registered KV tensors and the sidecar's pool."""

    def load(self, block_ids: Any, slots: Any, layout: BlockLayout, rank: int) -> Copy:
        """Queue slot slots[i] (this rank's shard) -> engine block block_ids[i]."""
        ...

    def save(self, block_ids: Any, slots: Any, layout: BlockLayout, rank: int) -> Copy:
        """Queue engine block block_ids[i] -> this rank's shard of slot slots[i]."""
        ...


def queue_copies(plan: PlanOps, copier: Copier, layout: BlockLayout, rank: int) -> list[Copy]:
    """Queue this rank's copy of every op of `plan`. If one cannot be queued,
    those already queued are let end before the error is raised: the sidecar
    reuses the slots once told of the failure."""
    copies: list[Copy] = []
    try:
        for _, kind, src, dst in plan.ops:
            if kind is OpKind.H2D:
                copies.append(copier.load(dst, src, layout, rank))
            else:
                copies.append(copier.save(src, dst, layout, rank))
    except Exception:
        for copy in copies:
            with contextlib.suppress(Exception):
                copy.synchronize()
        raise
    return copies


class TransferHandle:
    """A load or save in flight. `wait()` returns once the sidecar has
    acknowledged it: after a save's wait, any engine's lookup sees the blocks
    (those another engine was saving when this save was planned land with
    that engine's save).

    A load into CUDA tensors returns while its copies are still queued on the
    copier's stream: `wait_layer(i)` lets the engine's stream start on layer
    i while later layers load; `wait()` blocks until every layer has landed,
    then tells the sidecar, which keeps the blocks' slots locked until then
    (so always call it)."""

    def __init__(
        self,
        plan: PlanOps | None,
        num_tokens: int,
        ack: int | None,
        copies: Sequence[Copy] = (),
        *,
        report: Callable[[PlanOps, Sequence[Copy]], int],
        wait_reply: Callable[[int, float | None], object],
    ) -> None:
        """`ack`: the id of the sidecar's reply to the plan's report, once
        sent; `wait_reply(ack, timeout)` waits for it. `copies`: queued
        copies not reported yet, which `report(plan, copies)` waits for and
        tells the sidecar of, returning the id of its reply."""
        self.plan = plan
        self.num_tokens = num_tokens
        """Load: tokens now in the engine's KV cache. Save: tokens now cached."""
        self._ack = ack
        self._copies = list(copies)
        self._report = report
        self._wait_reply = wait_reply

    @property
    def done(self) -> bool:
        return self._ack is None and not self._copies

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make `stream` (default: the current CUDA stream) wait until model
        layer `layer` of a load has landed; returns at once. Copies into CPU
        tensors have landed already."""
        for copy in self._copies:
            copy.wait_layer(layer, stream)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the copies have landed and the sidecar confirmed;
        returns `num_tokens`. Raises SidecarUnavailable after `timeout`
        (default: the client's), or the copy's error (reported to the sidecar
        as a failed op)."""
        if self._copies:
            copies, self._copies = self._copies, []
            assert self.plan is not None
            self._ack = self._report(self.plan, copies)
        if self._ack is not None:
            self._wait_reply(self._ack, timeout)
            self._ack = None
        return self.num_tokens
