"""`Parallel`: where one vLLM rank stands among the tensor-parallel ranks of
its engine, and what that makes it do.

Every rank holds a shard of each block (its KV heads). The ranks register
under one engine id, each with its `tp_rank`, so the sidecar keeps one slot
per block with every rank's shard, and a plan ends only once every rank
has reported its copy. Rank 0 (the leader) asks the sidecar for each plan;
the others run the same plan (`RankRelay` hands it to them).

MLA (`one_copy`): the latent KV is the same on every rank, so one copy is
stored: rank 0 registers (TP size 1 in the namespace) and saves; every
other rank registers as an engine of its own and only loads, so each rank
copies the one stored block into its own cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Parallel:
    tp_rank: int = 0
    tp_size: int = 1
    one_copy: bool = False
    """MLA: every rank holds the same KV; store one copy, load it into all."""

    def __post_init__(self) -> None:
        for name in ("tp_rank", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")

    @property
    def shards(self) -> int:
        """Shards of a stored block: the namespace's TP size."""
        return 1 if self.one_copy else self.tp_size

    @property
    def relayed(self) -> bool:
        """Whether this rank's plans come from (or go to) other ranks."""
        return self.shards > 1

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def saves(self) -> bool:
        """Whether this rank copies blocks to the sidecar."""
        return self.relayed or self.leader

    def engine_id(self, base: str) -> str:
        """The engine id this rank registers under."""
        if self.one_copy and not self.leader:
            return f"{base}-worker-mla{self.tp_rank}"
        return f"{base}-worker"

    def register_args(self) -> dict[str, int]:
        """KVClient.register's TP keywords for this rank."""
        rank = self.tp_rank if self.relayed else 0
        return {"tp_rank": rank, "tp_size": self.shards}
