"""Layer-wise transfers (`layer_wise` on): what one step's layered loads
and saves share between the forward's thread and the transfer thread.

A save is planned at the step's first `save_kv_layer` and its copies
queued layer by layer as the forward computes them (a copy never reads a
layer the forward has not finished: it stops at the last split within the
prefix of layers computed, in whatever order they were reported); what is
left is copied after the forward, at `wait_for_save`. A synchronous load
is planned at `start_load_kv` and its layers copied in order, ahead of the
forward (a copy stops at the first split at or past the layer asked for):
`wait_for_layer_load` waits for its layer only.

Splits: where cuda_ext can cut a block's copy (`KVPlanes.layer_splits`):
every layer in a layer-major layout, only the whole block in a cross-layer
one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from engine_shim.kvconnector.metadata import LoadSpec, SaveSpec
from engine_shim.transfer import LayeredTransfer, TransferHandle

log = logging.getLogger(__name__)


@dataclass
class LayerJob:
    """One request's layered load or save in a step. Written on the
    transfer thread; the forward's thread reads `transfer` only once the
    thread's task for its layer is done (a Future's result orders them)."""

    spec: LoadSpec | SaveSpec
    transfer: LayeredTransfer | None = None
    """None: nothing to copy, or it failed."""
    in_cache: int = 0
    """A load's blocks in the engine's cache once it lands (a failure: its skipped ones)."""
    handle: TransferHandle | None = None
    """A load's, once its last layer is queued: reported as soon as its
    copies land, so the sidecar's answer comes during the forward."""


@dataclass
class StepSaves:
    """A step's layered saves, on the forward's thread."""

    step: int
    jobs: list[LayerJob]
    computed: set[int] = field(default_factory=set)
    """Layers the forward has computed (reported by `save_kv_layer`)."""
    prefix: int = 0
    """Layers [0, prefix) are computed: what the copies may read."""

    def computed_layer(self, layer: int) -> bool:
        """Note `layer` computed; whether the computed prefix grew (a copy
        never reads a layer past it, whatever order the layers come in)."""
        self.computed.add(layer)
        grown = self.prefix
        while grown in self.computed:
            grown += 1
        grew, self.prefix = grown > self.prefix, grown
        return grew


def save_stop(splits: Sequence[int], computed: int) -> int:
    """How far a save may copy once layers [0, computed) are computed: the
    last split at or before `computed` (0: none yet)."""
    return max((s for s in splits if s <= computed), default=0)


def load_stop(splits: Sequence[int], needed: int) -> int:
    """How far a load must copy for layers [0, needed) to land: the first
    split at or past `needed`."""
    return min(s for s in splits if s >= needed)


def copy_layers(
    jobs: list[LayerJob], layers: int, save: bool, stream: AbstractContextManager[None]
) -> None:
    """Queue the copies of layers [.., layers) of every job (a save's
    stop at the split before, a load's at the split past). A failure
    drops the job: a save's blocks are a later miss, a load's are
    recomputed. Never raises. `stream`: entered around the copies (the
    transfer thread's CUDA stream)."""
    with stream:
        for job in jobs:
            transfer = job.transfer
            if transfer is None:
                continue
            stop = (save_stop if save else load_stop)(transfer.splits, layers)
            if stop <= transfer.queued:
                continue
            try:
                transfer.copy_layers(stop)
                if not save and stop == transfer.num_layers:
                    job.handle = transfer.finish()  # reported once landed
            except Exception as err:
                log.warning("kvsidecar: layer copy of %s failed: %s", job.spec.req_id, err)
                job.transfer = None
                if isinstance(job.spec, LoadSpec):
                    job.in_cache = job.spec.skip_blocks


def finish_layered(job: LayerJob, stream: AbstractContextManager[None]) -> int:
    """Copy the layers left, then report the plan; blocks in the cache
    (a load's; a failure: its skipped ones). Never raises. `stream`: as
    for `copy_layers`."""
    transfer, spec = job.transfer, job.spec
    if transfer is None:
        return job.in_cache
    try:
        with stream:
            handle = job.handle
            if handle is None:
                if transfer.queued < transfer.num_layers:
                    transfer.copy_layers(transfer.num_layers)
                handle = transfer.finish()
            handle.wait()
        return job.in_cache
    except Exception as err:
        log.warning("kvsidecar: transfer of %s failed: %s", spec.req_id, err)
        return spec.skip_blocks if isinstance(spec, LoadSpec) else 0
