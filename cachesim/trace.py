"""Mooncake-format request traces, as flat numpy arrays of block ids.

A Mooncake trace is JSON lines with `timestamp`, `input_length`,
`output_length` and `hash_ids`. Each hash id names one 512-token block and is
prefix-addressed: two requests share an id at position i exactly when their
first (i+1) * 512 tokens are equal.

kvsidecar caches 16-token blocks, so each 512-token id h expands to
`512 // tokens_per_block` child ids `h * k + j` (j = 0..k-1). The children of
one id are always looked up together and in order, so the expanded trace is
prefix-addressed too, and hit ratios of a prefix cache with unlimited
capacity are the same at both granularities. (The last id of a request
usually covers a partial 512-token block; like the trace's own hash ids we
count it as whole.)

The block ids of all requests live in one flat int64 array with per-request
offsets: request r is `block_ids[offsets[r]:offsets[r + 1]]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Trace:
    """Requests as flat block ids.

    `hash_ids` / `hash_offsets` are the trace's own 512-token ids;
    `block_ids` / `offsets` the same requests at `tokens_per_block`
    granularity, with `blocks_per_hash` children per hash id.
    """

    hash_ids: np.ndarray
    hash_offsets: np.ndarray
    block_ids: np.ndarray
    offsets: np.ndarray
    blocks_per_hash: int
    timestamps: np.ndarray
    input_lengths: np.ndarray
    output_lengths: np.ndarray

    @property
    def num_requests(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def num_lookups(self) -> int:
        """Block lookups over the whole trace (every block of every request)."""
        return int(self.block_ids.size)

    @property
    def tokens_per_block(self) -> int:
        return MOONCAKE_BLOCK_TOKENS // self.blocks_per_hash

    def request(self, r: int) -> np.ndarray:
        return self.block_ids[self.offsets[r] : self.offsets[r + 1]]

    def num_unique_blocks(self) -> int:
        return int(np.unique(self.hash_ids).size) * self.blocks_per_hash


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check_tokens_per_block(tokens_per_block: int) -> None:
    if tokens_per_block <= 0 or MOONCAKE_BLOCK_TOKENS % tokens_per_block:
        raise ValueError(
            f"tokens_per_block must divide {MOONCAKE_BLOCK_TOKENS}, got {tokens_per_block}"
        )


def load_mooncake(path: str | Path, tokens_per_block: int = 16, limit: int | None = None) -> Trace:
    """Read a Mooncake JSONL trace (at most `limit` requests) and expand it.

    `tokens_per_block` must divide 512.
    """
    _check_tokens_per_block(tokens_per_block)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    ids: list[list[int]] = []
    stamps: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(ids) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                hashes = row["hash_ids"]
                if not isinstance(hashes, list) or not all(
                    type(h) is int and _INT64_MIN <= h <= _INT64_MAX for h in hashes
                ):
                    raise ValueError("hash_ids must be a list of 64-bit integers")
                ids.append(hashes)
                stamps.append(row.get("timestamp", 0))
                inputs.append(row.get("input_length", 0))
                outputs.append(row.get("output_length", 0))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from exc
    return trace_from_requests(ids, tokens_per_block, stamps, inputs, outputs)


def trace_from_requests(
    ids: list[list[int]],
    tokens_per_block: int = 16,
    timestamps: list[float] | None = None,
    input_lengths: list[int] | None = None,
    output_lengths: list[int] | None = None,
) -> Trace:
    """A Trace from each request's 512-token hash ids (lengths default to the ids')."""
    _check_tokens_per_block(tokens_per_block)
    lengths = np.fromiter((len(h) for h in ids), dtype=np.int64, count=len(ids))
    hash_offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=hash_offsets[1:])
    flat = np.fromiter((x for h in ids for x in h), dtype=np.int64, count=int(hash_offsets[-1]))
    k = MOONCAKE_BLOCK_TOKENS // tokens_per_block
    return Trace(
        hash_ids=flat,
        hash_offsets=hash_offsets,
        block_ids=expand_ids(flat, k),
        offsets=hash_offsets * k,
        blocks_per_hash=k,
        timestamps=np.asarray(timestamps or range(len(ids)), dtype=np.float64),
        input_lengths=np.asarray(input_lengths or (lengths * MOONCAKE_BLOCK_TOKENS), np.int64),
        output_lengths=np.asarray(output_lengths or np.zeros(len(ids)), dtype=np.int64),
    )


class InconsistentTrace(ValueError):
    """A trace whose ids are not prefix-addressed: one id under two parents."""


def check_prefix_consistent(trace: Trace) -> None:
    """Raise InconsistentTrace when a hash id follows two different ids (or
    follows one in a request and starts another).

    A Mooncake hash id names its whole prefix, so it always has the same
    parent; an id under two parents would make a prefix cache and Belady's
    model (which both rely on it) count hits the trace does not have.
    """
    ids, offsets = trace.hash_ids, trace.hash_offsets
    if ids.size == 0:
        return
    parents = np.empty_like(ids)
    parents[1:] = ids[:-1]
    starts = offsets[:-1][np.diff(offsets) > 0]
    parents[starts] = -1
    root = np.zeros(ids.size, dtype=bool)  # tells the root from a real id -1
    root[starts] = True
    pairs = np.unique(np.stack([ids, parents, root.astype(np.int64)], axis=1), axis=0)
    same_id = pairs[1:, 0] == pairs[:-1, 0]
    if not same_id.any():
        return
    i = int(np.flatnonzero(same_id)[0])
    bad, count = int(pairs[i, 0]), int(np.unique(pairs[1:, 0][same_id]).size)

    def name(row: np.ndarray) -> str:
        return "the start of a request" if row[2] else f"id {int(row[1])}"

    raise InconsistentTrace(
        f"the trace is not prefix-consistent: {count:,} hash ids appear under two "
        f"parents (e.g. id {bad} after {name(pairs[i])} and after {name(pairs[i + 1])}). "
        "A Mooncake hash id names a whole prefix, so a prefix cache would count hits "
        "this trace does not have; regenerate it with chained ids."
    )


def expand_ids(hash_ids: np.ndarray, k: int) -> np.ndarray:
    """Replace each id h by its k children h*k + 0 .. h*k + k-1, in order."""
    hash_ids = np.asarray(hash_ids, dtype=np.int64)
    if k == 1:
        same: np.ndarray = hash_ids.copy()
        return same
    children: np.ndarray = (hash_ids[:, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)
    return children


def request_index(offsets: np.ndarray) -> np.ndarray:
    """For each position of the flat array, the request it belongs to."""
    return np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))


def infinite_hits(ids: np.ndarray, offsets: np.ndarray) -> int:
    """Block hits of a prefix cache with unlimited capacity.

    A lookup hits when its id was inserted by an earlier request. With
    prefix-addressed ids the hits of one request form a prefix of it, so
    this equals the prefix-match count.
    """
    if ids.size == 0:
        return 0
    req = request_index(offsets)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    first_req = req[first]
    return int(np.count_nonzero(first_req[inverse.reshape(-1)] < req))


def infinite_hit_ratio(trace: Trace) -> float:
    """Block hits / block lookups with unlimited capacity (same at both granularities)."""
    if trace.hash_ids.size == 0:
        return 0.0
    return infinite_hits(trace.hash_ids, trace.hash_offsets) / trace.hash_ids.size
