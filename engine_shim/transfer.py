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

    def load(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        layers: tuple[int, int] | None = None,
    ) -> Copy:
        """Queue slot slots[i] (this rank's shard) -> engine block block_ids[i];
        `layers` (begin, end): those model layers only."""
        ...

    def save(
        self,
        block_ids: Any,
        slots: Any,
        layout: BlockLayout,
        rank: int,
        *,
        layers: tuple[int, int] | None = None,
    ) -> Copy:
        """Queue engine block block_ids[i] -> this rank's shard of slot slots[i];
        `layers` (begin, end): those model layers only."""
        ...


def queue_copies(
    plan: PlanOps,
    copier: Copier,
    layout: BlockLayout,
    rank: int,
    layers: tuple[int, int] | None = None,
) -> list[Copy]:
    """Queue this rank's copy of every op of `plan` (of model layers
    `layers` only, if given). If one cannot be queued, those already queued
    are let end before the error is raised: the sidecar reuses the slots
    once told of the failure."""
    copies: list[Copy] = []
    part = {} if layers is None else {"layers": layers}
    try:
        for _, kind, src, dst in plan.ops:
            if kind is OpKind.H2D:
                copies.append(copier.load(dst, src, layout, rank, **part))
            else:
                copies.append(copier.save(src, dst, layout, rank, **part))
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

    A load the sidecar planned into CUDA tensors returns while its copies
    are still queued on the copier's stream (a hot-path CPU hit has landed
    before `load` returns): `wait_layer(i)` lets the engine's stream start
    on layer i while later layers load; `wait()` blocks until every layer
    has landed, then tells the sidecar, which keeps the blocks' slots locked
    until then (so always call it)."""

    def __init__(
        self,
        plan: PlanOps | None,
        num_tokens: int,
        ack: int | None,
        copies: Sequence[Copy] = (),
        *,
        report: Callable[[PlanOps, Sequence[Copy]], int],
        wait_reply: Callable[[int, float | None], tuple[Any, list[bytes]]],
        count: Callable[[Any], int] | None = None,
        parts: Sequence[TransferHandle] = (),
    ) -> None:
        """`ack`: the id of the sidecar's reply to the plan's report, once
        sent; `wait_reply(ack, timeout)` waits for it. `copies`: queued
        copies not reported yet, which `report(plan, copies)` waits for and
        tells the sidecar of, returning the id of its reply. `count(reply)`:
        `num_tokens` as that reply says (None: as given). `parts`: the
        handles of a load asked for in parts (then `plan` is None), which
        this one waits for."""
        self.plan = plan
        self.num_tokens = num_tokens
        """Load: tokens now in the engine's KV cache. Save: tokens now cached."""
        self._ack = ack
        self._copies = list(copies)
        self._report = report
        self._wait_reply = wait_reply
        self._count = count
        self._parts = list(parts)

    @property
    def done(self) -> bool:
        return self._ack is None and not self._copies and all(p.done for p in self._parts)

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make `stream` (default: the current CUDA stream) wait until model
        layer `layer` of a load has landed; returns at once. Copies into CPU
        tensors have landed already."""
        for part in self._parts:
            part.wait_layer(layer, stream)
        for copy in self._copies:
            copy.wait_layer(layer, stream)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the copies have landed and the sidecar confirmed;
        returns `num_tokens`. Raises SidecarUnavailable after `timeout`
        (default: the client's), or the copy's error (reported to the sidecar
        as a failed op). A load in parts waits for every part, then raises
        the first part's error if one failed."""
        if self._parts:
            parts, self._parts = self._parts, []
            error: Exception | None = None
            for part in parts:
                try:
                    part.wait(timeout)
                except Exception as err:  # the others' slots are still held: go on
                    error = error or err
            if error is not None:
                raise error
        if self._copies:
            copies, self._copies = self._copies, []
            assert self.plan is not None
            self._ack = self._report(self.plan, copies)
        if self._ack is not None:
            reply, _ = self._wait_reply(self._ack, timeout)
            self._ack = None
            if self._count is not None:
                self.num_tokens = self._count(reply)
        return self.num_tokens


class LayeredTransfer:
    """A load or save planned before its copies: `copy_layers` queues the
    copies of a range of model layers (at `splits` only), as the engine
    computes them (a save) or is about to read them (a load); `finish()`
    once every layer is queued gives the handle that reports the plan.

    A range that cannot be queued fails the whole plan (the sidecar told,
    the copies queued so far let end); `finish()` then raises that error,
    so nothing of a failed plan is ever reported as done.

    `queue(layers)` queues the copies of a range (None: nothing to copy),
    `finish(copies)` reports them, `fail(err)` gives the plan up."""

    def __init__(
        self,
        plan: PlanOps | None,
        num_tokens: int,
        num_layers: int,
        splits: Sequence[int],
        *,
        queue: Callable[[tuple[int, int]], list[Copy]] | None,
        finish: Callable[[Sequence[Copy]], TransferHandle],
        fail: Callable[[Exception], None],
    ) -> None:
        self.plan = plan
        """The sidecar's plan, for the other TP ranks (None: none to share)."""
        self.num_tokens = num_tokens
        """Load: tokens in the engine's cache once it lands. Save: tokens cached."""
        self.num_layers = num_layers
        self.splits = tuple(splits)
        """Layer counts a range may end at (cuda_ext's `KVPlanes.layer_splits`)."""
        self.queued = 0
        """Layers [0, queued) have their copies queued."""
        self._queue, self._finish, self._fail = queue, finish, fail
        self._ranges: list[tuple[int, list[Copy]]] = []
        """(end layer, its range's copies), in order."""
        self._error: Exception | None = None
        self._finished = False

    def copy_layers(self, end: int) -> None:
        """Queue the copies of layers [queued, end): `end` one of `splits`,
        past `queued`. Raises the error of a copy that cannot be queued (the
        plan is then failed)."""
        if end not in self.splits or end <= self.queued:
            raise ValueError(f"copy up to layer {end}: one of {self.splits} past {self.queued}")
        if self._error is not None:
            raise self._error
        if self._queue is not None:
            try:
                self._ranges.append((end, self._queue((self.queued, end))))
            except Exception as err:
                self._error = err
                for _, copies in self._ranges:  # landed before the slots are given up
                    for copy in copies:
                        with contextlib.suppress(Exception):
                            copy.synchronize()
                self._ranges = []
                self._fail(err)
                raise
        self.queued = end

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make `stream` (default: the current CUDA stream) wait until the
        copy of `layer`, queued already, has landed; returns at once (copies
        into CPU tensors have landed when queued)."""
        for end, copies in list(self._ranges):
            if layer < end:
                for copy in copies:
                    copy.wait_layer(layer, stream)
                return

    def finish(self) -> TransferHandle:
        """The handle whose `wait()` waits for every copy and reports the plan;
        the error of a failed range, or ValueError if layers are not queued."""
        if self._error is not None:
            raise self._error
        if self.queued != self.num_layers or self._finished:
            raise ValueError(
                f"finish() once, with every layer queued ({self.queued} of {self.num_layers})"
            )
        self._finished = True  # the ranges stay: `wait_layer` may still be asked
        copies = [copy for _, queued in self._ranges for copy in queued]
        return self._finish(copies)
