"""`PageChain`: the kvsidecar keys of one SGLang storage call.

SGLang names every page by a SHA-256 chain hash (hex) of its tokens and
every page before it, seeded by the request's extra key and cache salt.
The sidecar's index is a radix tree over key sequences from the root, so
a call's pages are keyed together with the pages before them, which SGLang
hands over as `extra_info.prefix_keys` when started with
`"hicache_storage_pass_prefix_keys": true`: the chain is prefix + pages,
and the call's pages are the chain's blocks past `skip`.

The digests are chained again under the namespace's chain key
(`KVClient.digest_keys`, as the vLLM connector does with vLLM's block
hashes), so a page's key depends on the namespace (model, revision, tenant,
engine kind "sglang", pool layout, TP rank for MHA) and on the page's own
chain hash: two SGLang processes of one model and layout share pages, and
nothing keyed by tokens or by another engine ever equals them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from contract.ids import BlockKeys

DIGEST_HEX = 64
"""SGLang's page hashes: SHA-256 hex digests."""


class PrefixMissing(ValueError):
    """SGLang did not say where the call's pages sit in their sequence."""


@dataclass(frozen=True)
class PageChain:
    keys: BlockKeys
    """The chain from the sequence's first page: prefix pages, then the call's."""
    skip: int
    """Prefix pages: the call's pages are keys[skip:]."""

    @property
    def num_pages(self) -> int:
        """The call's pages."""
        return len(self.keys) - self.skip

    @classmethod
    def of(
        cls,
        pages: Sequence[str],
        prefix: Sequence[str] | None,
        digest_keys: Callable[[Sequence[bytes]], BlockKeys],
    ) -> PageChain:
        """The chain of `prefix` + `pages` through `digest_keys` (a
        KVClient's). PrefixMissing when `prefix` is None: SGLang was not
        told to pass it, and a page's place in its sequence is unknown."""
        if prefix is None:
            raise PrefixMissing(
                "SGLang passed no prefix_keys: start it with "
                '"hicache_storage_pass_prefix_keys": true in --hicache-storage-backend-extra-config'
            )
        chain = [*prefix, *pages]
        return cls(digest_keys(digests(chain)), len(prefix))

    def hits(self, chain_tokens: int, page_size: int) -> int:
        """The call's pages among `chain_tokens` leading tokens of the chain."""
        return min(max(chain_tokens // page_size - self.skip, 0), self.num_pages)

    def block_ids(self, pages: np.ndarray) -> np.ndarray:
        """Engine block ids for the whole chain: placeholders (0, never
        read nor written) for the prefix, then the call's host pages."""
        return np.concatenate([np.zeros(self.skip, dtype=np.int64), pages.astype(np.int64)])


def digests(hashes: Sequence[str]) -> list[bytes]:
    """SGLang's hex page hashes as bytes: 32-byte SHA-256 digests; any other
    string (a backend test's "key0") through BLAKE2b-256 of its UTF-8."""
    if all(isinstance(h, str) and len(h) == DIGEST_HEX for h in hashes):
        try:
            raw = bytes.fromhex("".join(hashes))
        except ValueError:
            pass
        else:
            return [raw[i : i + 32] for i in range(0, len(raw), 32)]
    return [_digest(h) for h in hashes]


def _digest(page_hash: str) -> bytes:
    if not isinstance(page_hash, str):
        raise TypeError(f"page keys are strings, got {type(page_hash).__name__}")
    if len(page_hash) == DIGEST_HEX:
        try:
            return bytes.fromhex(page_hash)
        except ValueError:
            pass
    return hashlib.blake2b(page_hash.encode(), digest_size=32).digest()
