"""Belady's optimal eviction for a prefix cache, as an upper bound for the policies.

Model (the same as `bench replay` drives the cache engine): requests come in
order; a request looks its blocks up in order and hits while they are cached,
so its hits are the longest cached prefix; then all its blocks are stored.
When a block must be stored and the cache is full, the optimum evicts the
cached block whose next use is farthest in the future - or skips storing the
new block when that block is itself the one used farthest in the future (MIN
with bypass). Counting hits block by block, this maximises hits over every
eviction policy, including ones that decline to store.

Prefix closure. Ids are prefix-addressed: every request that uses block b
uses its parent p earlier in the same request. So p's next use always comes
before b's, and p is never evicted while b stays, provided ties are broken
deeper-first. A tie happens only between blocks never used again; they get
priority `len(ids) + depth`, so a deeper block goes first. The cache is then
prefix-closed, and a request's cached blocks are exactly its cached prefix:
block-set hits and prefix hits are the same.

Next uses come from one stable argsort of the ids; the cache is a max-heap
of (priority, block) with lazy deletion: an entry is live when it equals the
block's current priority, and the heap is compacted when stale entries
outnumber live ones.
"""

from __future__ import annotations

import heapq

import numpy as np

from cachesim.trace import Trace


def next_use_priorities(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Eviction priority of each access: larger = evict sooner.

    The position of the next access to the same id, or `len(ids) + depth`
    (depth = position within its request) when there is none.
    """
    n = ids.size
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    nxt = np.full(n, -1, dtype=np.int64)
    nxt[order[:-1][same]] = order[1:][same]
    depth = np.arange(n, dtype=np.int64) - np.repeat(offsets[:-1], np.diff(offsets))
    return np.where(nxt >= 0, nxt, n + depth)


def belady_hits(ids: np.ndarray, offsets: np.ndarray, capacity: int) -> int:
    """Optimal block hits with room for `capacity` blocks, one block at a time."""
    return belady_hits_grouped(ids, offsets, capacity, group=1)


def belady_hits_grouped(
    unit_ids: np.ndarray, offsets: np.ndarray, capacity: int, group: int
) -> int:
    """Optimal block hits when every unit id stands for `group` blocks accessed together.

    This is `belady_hits` on the trace where each unit u is replaced by its
    blocks (u, 0) .. (u, group-1), computed `group` times faster. It is
    exact: the children of u are always accessed together, so they share one
    next use and their priorities order lexicographically as (unit priority,
    child index). Each unit therefore keeps a cached prefix of its children
    (a count), and a unit's misses take free room first, then evict the
    deepest children of the unit with the farthest next use while that is
    farther than u's own next use, then bypass the rest - the same choices
    the block-level algorithm makes one block at a time. The one difference
    is the order among blocks that are never used again, which changes
    neither how many of them are cached nor any later hit.
    """
    unit_ids = np.asarray(unit_ids, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    if capacity <= 0 or unit_ids.size == 0:
        return 0
    uniq, dense = np.unique(unit_ids, return_inverse=True)
    num_units = int(uniq.size)
    prio = next_use_priorities(unit_ids, offsets)
    return _simulate(
        dense.reshape(-1).tolist(), prio.tolist(), offsets.tolist(), num_units, capacity, group
    )


def _simulate(
    dense: list[int],
    prio: list[int],
    offsets: list[int],
    num_units: int,
    capacity: int,
    group: int,
) -> int:
    count = [0] * num_units  # cached children of each unit (a prefix of them)
    current = [-1] * num_units  # the unit's live priority while count > 0
    heap: list[int] = []  # -(priority * num_units + unit): max-heap in one int
    used = 0
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for r in range(len(offsets) - 1):
        missed = False
        for i in range(offsets[r], offsets[r + 1]):
            u = dense[i]
            p = prio[i]
            cached = count[u]
            if cached:
                if not missed:
                    hits += cached
                current[u] = p
                push(heap, -(p * num_units + u))
            need = group - cached
            if not need:
                continue
            missed = True
            take = min(need, capacity - used)
            used += take
            need -= take
            while need and heap:
                top = -heap[0]
                w, wp = top % num_units, top // num_units
                if current[w] != wp:
                    pop(heap)  # stale
                    continue
                if wp <= p:
                    break  # u is used no sooner than anything cached: bypass
                moved = min(need, count[w])
                count[w] -= moved
                need -= moved
                if not count[w]:
                    current[w] = -1
                    pop(heap)
            stored = group - need
            if stored and not cached:
                current[u] = p
                push(heap, -(p * num_units + u))
            count[u] = stored
        if len(heap) > 2 * used + 1024:
            heap = [e for e in heap if current[(-e) % num_units] == (-e) // num_units]
            heapq.heapify(heap)
    return hits


def opt_hits(trace: Trace, capacity: int) -> int:
    """Belady's optimal hits on `trace` at `capacity` blocks (exact; see above)."""
    return belady_hits_grouped(
        trace.hash_ids, trace.hash_offsets, capacity, group=trace.blocks_per_hash
    )
