"""Synthetic request traces of shapes the Mooncake conversation trace lacks.

Each shape is a sequence of requests in 512-token units, named the way
Mooncake names them: an id stands for its whole prefix (an id is made for
each (parent id, content) pair the first time it is seen), so every trace is
prefix-consistent by construction. The same shape, size and seed always give
the same trace.

Shapes (sizes in 512-token units):

- `tenants`: 40 tenants, each with its own system prompt of 4-16 units,
  picked with Zipf(1) popularity; each request is its tenant's prompt and a
  1-3 unit question of its own. Reuse is the hot prompts; the questions
  are one-hit wonders.
- `rag`: one 2-unit system prompt, then 2-3 documents of 2-6 units out of
  500 (Zipf(0.9) popularity, in retrieval order), then a 1-unit question.
  A document is shared only after the same preceding documents, so reuse
  is the system prompt, the popular first documents and popular pairs.
- `sessions`: 64 chat sessions open at once, each of 4-40 turns; a request
  is a random open session's next turn: one shared 1-unit system prompt,
  then every earlier turn (a 1-unit user message and a 1-unit answer),
  then the new message. A finished session is replaced by a new one.
  Reuse is each session's previous turn, after the other sessions' turns.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

from cachesim.trace import Trace, trace_from_requests

DEFAULT_SEED = 0


class _PrefixIds:
    """Chained ids: one per (parent id, content) pair, in order of first use."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}

    def extend(self, prefix: list[int], contents: list[Hashable]) -> list[int]:
        ids = list(prefix)
        parent = ids[-1] if ids else -1
        for content in contents:
            parent = self._ids.setdefault((parent, content), len(self._ids))
            ids.append(parent)
        return ids


def _zipf(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    ranks = list(range(n))
    return lambda: rng.choices(ranks, weights)[0]


def tenants(rng: random.Random, num_requests: int) -> list[list[int]]:
    names = _PrefixIds()
    prompts = [rng.randint(4, 16) for _ in range(40)]
    pick = _zipf(rng, len(prompts), 1.0)
    requests = []
    for r in range(num_requests):
        t = pick()
        contents: list[Hashable] = [("system", t, i) for i in range(prompts[t])]
        contents += [("question", r, i) for i in range(rng.randint(1, 3))]
        requests.append(names.extend([], contents))
    return requests


def rag(rng: random.Random, num_requests: int) -> list[list[int]]:
    names = _PrefixIds()
    docs = [rng.randint(2, 6) for _ in range(500)]
    pick = _zipf(rng, len(docs), 0.9)
    requests = []
    for r in range(num_requests):
        chosen: list[int] = []
        want = rng.randint(2, 3)
        while len(chosen) < want:
            d = pick()
            if d not in chosen:
                chosen.append(d)
        contents: list[Hashable] = [("system", i) for i in range(2)]
        contents += [("doc", d, i) for d in chosen for i in range(docs[d])]
        contents.append(("question", r))
        requests.append(names.extend([], contents))
    return requests


def sessions(rng: random.Random, num_requests: int) -> list[list[int]]:
    names = _PrefixIds()
    system = names.extend([], ["system"])
    open_: list[tuple[int, list[int], int]] = []  # (session, context so far, turns left)
    started = 0
    requests = []
    for _ in range(num_requests):
        while len(open_) < 64:
            open_.append((started, system, rng.randint(4, 40)))
            started += 1
        i = rng.randrange(len(open_))
        session, context, left = open_[i]
        turn = len(context)
        request = names.extend(context, [("user", session, turn)])
        requests.append(request)
        context = names.extend(request, [("answer", session, turn)])
        if left > 1:
            open_[i] = (session, context, left - 1)
        else:
            open_.pop(i)
    return requests


SHAPES: dict[str, Callable[[random.Random, int], list[list[int]]]] = {
    "tenants": tenants,
    "rag": rag,
    "sessions": sessions,
}
DEFAULT_REQUESTS = {"tenants": 4000, "rag": 4000, "sessions": 3000}
"""About 1.5-2.5M lookups of 16-token blocks each: seconds per policy pass."""


def generate(
    shape: str,
    num_requests: int | None = None,
    seed: int = DEFAULT_SEED,
    tokens_per_block: int = 16,
) -> Trace:
    """The `shape` trace of `num_requests` requests (default DEFAULT_REQUESTS)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; allowed: {', '.join(SHAPES)}")
    n = DEFAULT_REQUESTS[shape] if num_requests is None else num_requests
    return trace_from_requests(SHAPES[shape](random.Random(seed), n), tokens_per_block)
