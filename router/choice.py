"""Worker choice: the cost of sending a request to each worker, and the pick.

cost(w) = overlap_weight * (request blocks - blocks w already holds)
          + decode load blocks of w

The first term is the prefill w would still compute, the second the decode
work already queued on it. The lowest cost wins; ties go to the worker with
fewer cached blocks (more room), then to the lowest worker id, so a choice at
temperature 0 is deterministic. With a temperature T > 0 the pick is drawn
from softmax(-(cost - min) / (T * spread)), spread = max(cost range, 1), from
a seeded generator: reproducible, and free of the cost's unit.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from router.index import OverlapScores
from router.keys import Worker


class Choice(NamedTuple):
    worker: Worker
    overlap: int
    """Leading request blocks the chosen worker already holds."""
    cost: float
    costs: dict[Worker, float]
    """Every candidate's cost."""
    scores: OverlapScores
    """The overlaps the choice was made on."""


MAX_OVERLAP_WEIGHT = 1e12
"""Larger weights would make costs overflow to infinity (and a temperature's
weights NaN) on long requests."""


class NoWorkers(ValueError):
    """No candidate worker is known: nothing to route to."""


class WorkerSelector:
    def __init__(
        self, overlap_weight: float = 1.0, temperature: float = 0.0, seed: int = 0
    ) -> None:
        if not 0 <= overlap_weight <= MAX_OVERLAP_WEIGHT:
            raise ValueError(
                f"overlap_weight must be in [0, {MAX_OVERLAP_WEIGHT:g}], got {overlap_weight}"
            )
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self._rng = random.Random(seed)

    def costs(
        self,
        scores: OverlapScores,
        request_blocks: int,
        candidates: Iterable[Worker],
        loads: Mapping[Worker, int] | None = None,
    ) -> dict[Worker, float]:
        loads = loads or {}
        out = {}
        for w in candidates:
            prefill = request_blocks - min(scores.scores.get(w, 0), request_blocks)
            out[w] = self.overlap_weight * prefill + loads.get(w, 0)
        return out

    def select(
        self,
        scores: OverlapScores,
        request_blocks: int,
        candidates: Iterable[Worker] | None = None,
        loads: Mapping[Worker, int] | None = None,
    ) -> Choice:
        """Pick among `candidates` (default: every worker in `scores.tree_sizes`,
        the known ones); ValueError if a candidate is not known."""
        pool = sorted(scores.tree_sizes if candidates is None else set(candidates))
        if candidates is not None:
            unknown = [w for w in pool if w not in scores.tree_sizes]
            if unknown:
                raise ValueError(
                    f"{len(unknown)} candidate(s) not known to the router, first {unknown[0]}"
                )
            if not pool:
                raise ValueError("candidates is empty")
        if not pool:
            raise NoWorkers("no worker is known to the router yet")
        costs = self.costs(scores, request_blocks, pool, loads)
        if self.temperature > 0:
            best = self._draw(pool, costs)
        else:
            best = min(pool, key=lambda w: (costs[w], scores.tree_sizes.get(w, 0), w))
        overlap = min(scores.scores.get(best, 0), request_blocks)
        return Choice(best, overlap, costs[best], costs, scores)

    def _draw(self, pool: list[Worker], costs: dict[Worker, float]) -> Worker:
        low = min(costs.values())
        spread = max(max(costs.values()) - low, 1.0)
        weights = [math.exp(-(costs[w] - low) / (self.temperature * spread)) for w in pool]
        return self._rng.choices(pool, weights)[0]
