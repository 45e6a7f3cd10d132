"""The kinds of copy a plan is made of.

The control plane builds plans of these ops; the engine-side kinds (H2D,
D2H) travel to the engine in plan replies (`contract.replies.PlanOp`).
"""

from __future__ import annotations

import enum


class OpKind(enum.Enum):
    H2D = "H2D"  # CPU slots -> GPU blocks
    D2H = "D2H"  # GPU blocks -> CPU slots
    DISK2H = "DISK2H"  # SSD slots -> CPU slots
    H2DISK = "H2DISK"  # CPU slots -> SSD slots
    REMOTE2H = "REMOTE2H"  # remote slots -> CPU slots
    H2REMOTE = "H2REMOTE"  # CPU slots -> remote slots

    @property
    def on_engine(self) -> bool:
        """Whether the engine shim (not the sidecar) executes this op."""
        return self in (OpKind.H2D, OpKind.D2H)
