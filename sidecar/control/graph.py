"""TransferGraph: the ops of one plan and their dependencies.

A plan moves blocks between tiers. Engine-side ops (H2D, D2H) run in the
engine shim; sidecar-side ops run on the sidecar's SSD and remote pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contract.ops import OpKind


@dataclass(frozen=True)
class TransferOp:
    """Copy block src[i] to dst[i] for every i, after every op in `deps` is done.

    src and dst hold slot ids of the source and destination tier (GPU block
    ids for the GPU side of H2D and D2H).
    """

    op_id: int
    kind: OpKind
    src: np.ndarray
    dst: np.ndarray
    deps: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return int(self.src.size)


@dataclass
class TransferGraph:
    """Ops in dependency order: every op's deps come before it in `ops`."""

    ops: list[TransferOp] = field(default_factory=list)

    def add(
        self, kind: OpKind, src: np.ndarray, dst: np.ndarray, deps: tuple[int, ...] = ()
    ) -> int:
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(f"{kind.value}: src {src.shape} and dst {dst.shape} differ")
        if any(d >= len(self.ops) or d < 0 for d in deps):
            raise ValueError(f"{kind.value}: dependency on an op not yet in the graph: {deps}")
        op_id = len(self.ops)
        self.ops.append(TransferOp(op_id, kind, src, dst, deps))
        return op_id

    def __len__(self) -> int:
        return len(self.ops)

    def of_kind(self, kind: OpKind) -> list[TransferOp]:
        return [op for op in self.ops if op.kind is kind]

    @property
    def engine_ops(self) -> list[TransferOp]:
        return [op for op in self.ops if op.kind.on_engine]

    @property
    def sidecar_ops(self) -> list[TransferOp]:
        return [op for op in self.ops if not op.kind.on_engine]
