"""Keying vLLM's blocks by their tokens, so prompts can be matched against them.

vLLM names a block by a hash the router cannot recompute from a prompt (its
seed and encoding are the engine's own). Its BlockStored events also carry
the blocks' token ids, so, as Dynamo's indexer does, the router keys each
block by a chained hash of its tokens (`KeyHasher.hash_tokens` from the
parent block's key) and remembers, per worker rank, which token key each
vLLM hash stands for: removals and later stores name blocks by vLLM hash.

A store whose tokens are missing, of another block size than the hasher's,
of a LoRA adapter, or continuing a parent this rank's map does not hold is
dropped (counted by the caller): it would key blocks no prompt can match.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from contract.blocks import KeyHasher
from contract.events import Cleared, Removed, RouterEvent, Stored
from router.keys import BlockKey, Worker, split_keys
from router.vllm_events import StoredTokens


class Untokenized(ValueError):
    """A vLLM store the token keys cannot follow (why in the message)."""


class TokenKeyer:
    """Per worker rank, vLLM block key -> token key; translates events."""

    def __init__(self, hasher: KeyHasher) -> None:
        self.hasher = hasher
        self._maps: dict[Worker, dict[BlockKey, BlockKey]] = {}

    def translate(self, w: Worker, event: RouterEvent, tokens: StoredTokens | None) -> RouterEvent:
        """The event keyed by tokens (Untokenized if it cannot be). Call
        `commit` once the index took it, so that a rejected store leaves no
        mapping behind."""
        if isinstance(event, Cleared):
            return event
        known = self._maps.get(w, {})
        if isinstance(event, Removed):
            return Removed([known[k] for k in event.keys if k in known])
        assert isinstance(event, Stored)
        if tokens is None:
            raise Untokenized("BlockStored carries no token ids")
        if tokens.lora_id is not None:
            raise Untokenized(f"BlockStored of LoRA adapter {tokens.lora_id}")
        tpb = self.hasher.tokens_per_block
        if tokens.block_size != tpb or len(tokens.token_ids) != tpb * len(event.keys):
            raise Untokenized(
                f"{len(event.keys)} block(s) of {tokens.block_size} tokens with "
                f"{len(tokens.token_ids)} token ids (the router keys blocks of {tpb})"
            )
        parent = None
        if event.parent is not None:
            parent = known.get(event.parent)
            if parent is None:
                raise Untokenized("BlockStored continues a block this rank's map lacks")
        try:
            ids = np.asarray(tokens.token_ids, dtype=np.int64)
            keys = self.hasher.hash_tokens(ids, parent)
        except (ValueError, OverflowError) as err:  # an id out of range: this event only
            raise Untokenized(f"BlockStored with token ids the router cannot hash: {err}") from err
        return Stored(split_keys(keys.tobytes()), parent)

    def commit(self, w: Worker, event: RouterEvent, keyed: RouterEvent) -> None:
        """Record what `translate` gave for `event`, now applied."""
        if isinstance(event, Cleared):
            self.clear_worker(w)
        elif isinstance(event, Removed):
            known = self._maps.get(w, {})
            for k in event.keys:
                known.pop(k, None)
        else:
            assert isinstance(event, Stored) and isinstance(keyed, Stored)
            self._maps.setdefault(w, {}).update(zip(event.keys, keyed.keys, strict=True))

    def clear_rank(self, w: Worker) -> None:
        self._maps.pop(w, None)

    def clear_worker(self, w: Worker) -> None:
        """Forget every rank of `w.worker_id` (a Cleared from any rank)."""
        for rank in [r for r in self._maps if r.worker_id == w.worker_id]:
            del self._maps[rank]

    def blocks(self, ranks: Iterable[Worker] | None = None) -> int:
        """vLLM blocks mapped, over `ranks` (default: all)."""
        ranks = self._maps if ranks is None else ranks
        return sum(len(self._maps.get(r, {})) for r in ranks)
