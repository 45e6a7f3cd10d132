"""Block-key hashing speed: 32,768 tokens into 2,048 chained keys.

Called by `kvsidecar bench index`. The floor is one hashlib.blake2b call over
the same token bytes (raw hash throughput, no per-block work), measured in
the same run; the chained hash cannot beat it.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable

import numpy as np

from contract.blocks import BLAKE2B_IMPL, KeyHasher, Namespace

NUM_TOKENS = 32_768
TOKENS_PER_BLOCK = 16

NAMESPACE = Namespace(
    model_name="bench-model",
    model_revision="0",
    layout="flash_attn",
    dtype="bfloat16",
    tp_size=1,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    tokens_per_block=TOKENS_PER_BLOCK,
)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e6


def measure_hashing(repeats: int = 50) -> dict[str, float | str]:
    """Median ms to key 32,768 int64 tokens (2,048 blocks of 16) through `hash_tokens`.

    Keys: hash_ms_blake2b (default implementation, named by blake2b_impl),
    hash_ms_blake2b_python (the hashlib fallback), hash_ms_xxh3_128,
    floor_ms_blake2b_bulk and blake2b_vs_floor (hash_ms_blake2b / floor).
    """
    tokens = np.random.default_rng(0).integers(0, 150_000, NUM_TOKENS, dtype=np.int64)
    token_bytes = tokens.astype("<i4").tobytes()
    hashers = {
        "hash_ms_blake2b": KeyHasher(NAMESPACE, secret=b"bench"),
        "hash_ms_blake2b_python": KeyHasher(NAMESPACE, secret=b"bench", impl="python"),
        "hash_ms_xxh3_128": KeyHasher(NAMESPACE, secret=b"bench", algorithm="xxh3_128"),
    }
    result: dict[str, float | str] = {"blake2b_impl": BLAKE2B_IMPL}
    for name, hasher in hashers.items():
        result[name] = _median_ms(lambda h=hasher: h.hash_tokens(tokens), repeats)
    floor = _median_ms(lambda: hashlib.blake2b(token_bytes, digest_size=16).digest(), repeats)
    result["floor_ms_blake2b_bulk"] = floor
    result["blake2b_vs_floor"] = float(result["hash_ms_blake2b"]) / floor
    return result


if __name__ == "__main__":
    for key, value in measure_hashing(200).items():
        print(f"{key:24} {value:.3f}" if isinstance(value, float) else f"{key:24} {value}")
