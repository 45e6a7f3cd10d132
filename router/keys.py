"""Typed ids of the router: block keys and workers.

The router compares the same 16-byte chained keys the sidecar stores
(`contract.ids.BlockKey`). Hashes published by vLLM engines (ints or
bytes, depending on the vLLM version) are mapped into that key type by
`vllm_key`, under their own personalisation so they never equal a sidecar key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple, NewType

from contract.ids import KEY_BYTES, BlockKey, split_keys

__all__ = [
    "KEY_BYTES",
    "BlockKey",
    "Worker",
    "WorkerId",
    "split_keys",
    "vllm_key",
    "vllm_keys",
    "worker",
]

WorkerId = NewType("WorkerId", int)
"""One engine instance (a sidecar host, or one vLLM engine without a sidecar)."""


class Worker(NamedTuple):
    """Where a request can be sent: a worker and one of its data-parallel ranks."""

    worker_id: WorkerId
    dp_rank: int = 0

    def __str__(self) -> str:
        return f"{self.worker_id}/{self.dp_rank}"


def worker(worker_id: int, dp_rank: int = 0) -> Worker:
    return Worker(WorkerId(int(worker_id)), int(dp_rank))


_VLLM_PERSON = b"kvs-vllm-hash"


def vllm_key(block_hash: int | bytes) -> BlockKey:
    """A vLLM block hash (int in older vLLM, bytes in newer) as a router key.

    The same hash always maps to the same key, so stores, removals and
    queries that carry vLLM hashes agree with each other.
    """
    if isinstance(block_hash, bool) or not isinstance(block_hash, int | bytes):
        raise ValueError(f"a vLLM block hash is an int or bytes, got {type(block_hash).__name__}")
    data = b"i" + str(block_hash).encode() if isinstance(block_hash, int) else b"b" + block_hash
    digest = hashlib.blake2b(data, digest_size=KEY_BYTES, person=_VLLM_PERSON).digest()
    return BlockKey(digest)


def vllm_keys(hashes: Sequence[int | bytes]) -> list[BlockKey]:
    return [vllm_key(h) for h in hashes]
