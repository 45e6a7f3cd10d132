"""The prompts of `kvsidecar bench ttft`: follow-ups of the Mooncake
conversation trace (later turns that reuse at least half of an earlier
request's prefix), scaled down for small models, with token ids of their
own; and the break-even sweep's prompts. See bench/ttft.py."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachesim.trace import MOONCAKE_BLOCK_TOKENS, load_mooncake

MIN_REUSE = 0.5  # a follow-up shares at least this share of its hash ids
TOKENS_PER_BLOCK = 16


@dataclass(frozen=True)
class Case:
    """One prompt and the prefix of it an earlier prompt saved."""

    ids: np.ndarray
    cached: int
    """Leading tokens saved before (full blocks, short of the last token):
    what a hit must load."""
    target: int | None = None
    """The length it was picked for; None in the break-even sweep."""
    request: int | None = None
    """Its index in the trace; None in the break-even sweep."""
    trace_tokens: int | None = None


@dataclass(frozen=True)
class FollowUp:
    request: int
    """Its index in the trace."""
    trace_tokens: int
    hash_ids: np.ndarray
    shared_ids: int
    """Leading hash ids an earlier request had."""
    scale: int

    @property
    def unit(self) -> int:
        """Tokens per trace hash id after scaling."""
        return MOONCAKE_BLOCK_TOKENS // self.scale

    @property
    def tokens(self) -> int:
        """Prompt length after scaling."""
        return min(-(-self.trace_tokens // self.scale), self.hash_ids.size * self.unit)

    @property
    def cacheable(self) -> int:
        """Leading tokens an earlier turn cached: the shared ids' tokens, full blocks only."""
        shared = min(self.shared_ids * self.unit, self.tokens - 1)
        return shared // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK


def follow_ups(path: Path, scale: int) -> list[FollowUp]:
    """Every request sharing at least MIN_REUSE of its hash ids with an
    earlier one. Hash ids are prefix-chained, so a leading id seen before
    means the whole prefix up to it was seen before."""
    trace = load_mooncake(path)
    seen: set[int] = set()
    out = []
    for r in range(trace.num_requests):
        ids = trace.hash_ids[trace.hash_offsets[r] : trace.hash_offsets[r + 1]]
        shared = 0
        while shared < ids.size and int(ids[shared]) in seen:
            shared += 1
        if ids.size and shared / ids.size >= MIN_REUSE:
            out.append(FollowUp(r, int(trace.input_lengths[r]), ids, shared, scale))
        seen.update(int(h) for h in ids)
    return out


def pick(candidates: list[FollowUp], target: int, k: int, seed: int) -> list[FollowUp]:
    """Up to k follow-ups whose scaled length is within 0.8-1.25x of `target`."""
    near = [f for f in candidates if 0.8 * target <= f.tokens <= 1.25 * target and f.cacheable]
    return sorted(random.Random(seed + target).sample(near, min(k, len(near))), key=_request)


def _request(f: FollowUp) -> int:
    return f.request


def prompt_tokens(f: FollowUp, vocab: int, salt: int = 0) -> np.ndarray:
    """`f.tokens` token ids: `f.unit` ids per hash id, drawn from a generator
    seeded by (salt, id): prompts of one salt that share hash ids share tokens."""
    parts = [np.random.default_rng((salt, int(h))).integers(0, vocab, f.unit) for h in f.hash_ids]
    return np.concatenate(parts)[: f.tokens]


def trace_cases(
    candidates: list[FollowUp], targets: list[int], k: int, seed: int, vocab: int
) -> list[Case]:
    """Up to k follow-ups per target length, each with tokens of its own."""
    cases: list[Case] = []
    for target in targets:
        chosen = pick(candidates, target, k, seed)
        if not chosen:
            print(f"no follow-up of ~{target} tokens in the trace", file=sys.stderr)
        for f in chosen:
            ids = prompt_tokens(f, vocab, salt=len(cases))
            cases.append(Case(ids, f.cacheable, target, f.request, f.trace_tokens))
    return cases


def sweep_cases(lengths: list[int], seed: int, vocab: int) -> list[Case]:
    """Random prompts whose every full block short of the last token is cached."""
    rng = np.random.default_rng((seed, 1))
    return [
        Case(rng.integers(0, vocab, n), (n - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK)
        for n in lengths
        if n > TOKENS_PER_BLOCK
    ]
