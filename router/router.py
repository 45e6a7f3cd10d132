"""Router: the Python API of the cluster router.

It owns one global index, a worker selector and per-worker hit stats, and
takes KV events from any source (the sidecar publisher's subscriber, vLLM's
events, or a caller). It does no I/O: `router.serve` and
`router.subscriber` are the shell around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from contract.blocks import KeyHasher
from contract.events import Cleared, Removed, RouterEvent, Stored
from router.choice import Choice, WorkerSelector
from router.index import SWEEP_SLICE, KvIndex, OverlapScores, default_index, make_index
from router.keys import BlockKey, Worker, WorkerId, split_keys
from router.stats import RouterStats


class Router:
    def __init__(
        self,
        index: KvIndex | str | None = None,
        *,
        overlap_weight: float = 1.0,
        temperature: float = 0.0,
        seed: int = 0,
        window: int = 1000,
        hasher: KeyHasher | None = None,
    ) -> None:
        """`index`: an index or its name (default: `default_index()`).
        `hasher` turns token ids into the sidecars' block keys (needed only
        by `choose_tokens`); it must use the sidecars' namespace."""
        if index is None:
            index = default_index()
        self.index = make_index(index) if isinstance(index, str) else index
        self.selector = WorkerSelector(overlap_weight, temperature, seed)
        self.stats = RouterStats(window)
        self.hasher = hasher
        self.events_applied = 0

    def apply(self, worker: Worker, events: Iterable[RouterEvent]) -> None:
        """Apply events in order. The first that fails raises (RouterIndexError)
        with the events before it applied and the failing one not."""
        for event in events:
            if isinstance(event, Stored):
                self.index.apply_stored(worker, event.keys, event.parent)
            elif isinstance(event, Removed):
                self.index.apply_removed(worker, event.keys)
            else:
                assert isinstance(event, Cleared)
                self.index.apply_cleared(worker)  # every rank of the worker id
            self.events_applied += 1

    def add_worker(self, worker: Worker) -> None:
        self.index.add_worker(worker)

    def clear_rank(self, worker: Worker) -> None:
        """Forget the blocks of this rank alone (its event stream was reset)."""
        self.index.clear_rank(worker)

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget every rank of `worker_id`, in O(1) (see `sweep`)."""
        self.index.remove_worker(worker_id)
        self.stats.forget(worker_id)

    def sweep(self, max_blocks: int = SWEEP_SLICE) -> bool:
        """Drop up to `max_blocks` entries of cleared or removed workers from
        the index; whether some are left. Call it between requests until False."""
        return self.index.sweep(max_blocks)

    def find_matches(self, keys: Sequence[BlockKey], early_exit: bool = False) -> OverlapScores:
        return self.index.find_matches(keys, early_exit)

    def choose(
        self,
        keys: Sequence[BlockKey],
        loads: Mapping[Worker, int] | None = None,
        candidates: Iterable[Worker] | None = None,
    ) -> Choice:
        """The worker for a request of these block keys (NoWorkers if none is
        known; ValueError for a negative load)."""
        if loads and min(loads.values()) < 0:
            raise ValueError("loads must be >= 0")
        scores = self.index.find_matches(keys)
        choice = self.selector.select(scores, len(keys), candidates, loads)
        self.stats.record(choice.worker, len(keys), choice.overlap)
        return choice

    def keys_of_tokens(self, tokens: Sequence[int] | np.ndarray) -> list[BlockKey]:
        """The sidecars' keys of the full blocks of `tokens` (ValueError if
        this router has no hasher or a token is out of range)."""
        if self.hasher is None:
            raise ValueError("this router has no token hasher (start it with --namespace)")
        try:
            raw = self.hasher.hash_tokens(tokens).tobytes()
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"bad tokens: {exc}") from None
        return split_keys(raw)
