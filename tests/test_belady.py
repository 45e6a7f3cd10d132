"""cachesim.belady against simple references on small random prefix-addressed traces."""

from __future__ import annotations

import random
from functools import cache

import numpy as np
import pytest

from cachesim.belady import belady_hits, belady_hits_grouped, next_use_priorities
from cachesim.trace import expand_ids, infinite_hits


def random_trace(rng: random.Random, num_requests: int, max_new: int) -> list[list[int]]:
    """Prefix-addressed requests: a prefix of an earlier request plus fresh ids."""
    requests: list[list[int]] = []
    next_id = 0
    for _ in range(num_requests):
        prefix: list[int] = []
        if requests and rng.random() < 0.8:
            base = rng.choice(requests)
            prefix = base[: rng.randint(0, len(base))]
        new = list(range(next_id, next_id + rng.randint(0 if prefix else 1, max_new)))
        next_id += len(new)
        requests.append(prefix + new)
    return requests


def flatten(requests: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in requests], out=offsets[1:])
    ids = np.array([x for r in requests for x in r], dtype=np.int64)
    return ids, offsets


def reference_belady(requests: list[list[int]], capacity: int) -> int:
    """MIN with bypass, by scanning the future on every miss (deeper first on ties)."""
    flat = [(x, depth) for r in requests for depth, x in enumerate(r)]

    def priority(block: int, depth: int, now: int) -> tuple[int, int]:
        for j in range(now + 1, len(flat)):
            if flat[j][0] == block:
                return (0, j)
        return (1, depth)

    cache: dict[int, int] = {}  # block -> depth
    hits = pos = 0
    for request in requests:
        missed = False
        for depth, block in enumerate(request):
            if block in cache:
                hits += not missed
            else:
                missed = True
                if len(cache) < capacity:
                    cache[block] = depth
                elif capacity:
                    victim = max(cache, key=lambda b: priority(b, cache[b], pos))
                    if priority(victim, cache[victim], pos) > priority(block, depth, pos):
                        del cache[victim]
                        cache[block] = depth
            pos += 1
    return hits


def exhaustive_best(requests: list[list[int]], capacity: int) -> int:
    """The most prefix hits any demand policy can get: tries every choice on every miss."""
    flat = [(x, r_i) for r_i, r in enumerate(requests) for x in r]
    starts = {sum(len(r) for r in requests[:i]) for i in range(len(requests))}

    @cache
    def best(i: int, cached: frozenset, missed: bool) -> int:
        if i == len(flat):
            return 0
        missed = missed and i not in starts
        block = flat[i][0]
        if block in cached:
            return (not missed) + best(i + 1, cached, missed)
        options = [cached]  # bypass
        if len(cached) < capacity:
            options.append(cached | {block})
        elif capacity:
            options.extend((cached - {v}) | {block} for v in cached)
        return max(best(i + 1, c, True) for c in options)

    return best(0, frozenset(), False)


def lru_hits(requests: list[list[int]], capacity: int) -> int:
    """A block-level LRU prefix cache: lookups, then store the whole request."""
    order: dict[int, None] = {}
    hits = 0
    for request in requests:
        for block in request:
            if block not in order:
                break
            hits += 1
        for block in request:
            order.pop(block, None)
            order[block] = None
            if len(order) > capacity:
                order.pop(next(iter(order)))
    return hits


def fifo_hits(requests: list[list[int]], capacity: int) -> int:
    order: dict[int, None] = {}
    hits = 0
    for request in requests:
        for block in request:
            if block not in order:
                break
            hits += 1
        for block in request:
            if block not in order:
                order[block] = None
                if len(order) > capacity:
                    order.pop(next(iter(order)))
    return hits


def test_next_use_priorities():
    ids = np.array([5, 6, 5, 7, 6])
    offsets = np.array([0, 2, 5])
    n = ids.size
    # position of the next use, else n + depth in the request
    assert next_use_priorities(ids, offsets).tolist() == [2, 4, n + 0, n + 1, n + 2]


@pytest.mark.parametrize("seed", range(40))
def test_matches_exhaustive_search_on_tiny_traces(seed):
    rng = random.Random(seed)
    requests = random_trace(rng, num_requests=rng.randint(2, 6), max_new=3)
    ids, offsets = flatten(requests)
    for capacity in range(0, 6):
        got = belady_hits(ids, offsets, capacity)
        assert got == exhaustive_best(requests, capacity), (requests, capacity)


@pytest.mark.parametrize("seed", range(30))
def test_matches_reference_and_beats_policies(seed):
    rng = random.Random(1000 + seed)
    requests = random_trace(rng, num_requests=40, max_new=6)
    ids, offsets = flatten(requests)
    for capacity in (1, 3, 8, 20, 60):
        got = belady_hits(ids, offsets, capacity)
        assert got == reference_belady(requests, capacity)
        assert got >= lru_hits(requests, capacity)
        assert got >= fifo_hits(requests, capacity)


@pytest.mark.parametrize("seed", range(30))
def test_grouped_equals_block_level_on_expanded_trace(seed):
    rng = random.Random(2000 + seed)
    requests = random_trace(rng, num_requests=30, max_new=4)
    ids, offsets = flatten(requests)
    group = rng.choice([2, 3, 4])
    expanded = expand_ids(ids, group)
    for capacity in (1, 2, 5, 7, 13, 30, 200):
        grouped = belady_hits_grouped(ids, offsets, capacity, group)
        assert grouped == belady_hits(expanded, offsets * group, capacity), (capacity, group)


def test_unlimited_capacity_reaches_infinite_hits():
    rng = random.Random(7)
    requests = random_trace(rng, num_requests=200, max_new=5)
    ids, offsets = flatten(requests)
    assert belady_hits(ids, offsets, ids.size) == infinite_hits(ids, offsets)
    assert belady_hits(ids, offsets, 0) == 0
