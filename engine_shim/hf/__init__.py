"""kvsidecar as the prefix cache of a transformers causal LM (needs transformers).

    from engine_shim import KVClient
    from engine_shim.hf import CachedLM, tiny_llama

    lm = CachedLM(tiny_llama(seed=0), KVClient.connect())
    logits, info = lm.prefill(prompt_ids)
    print(info.loaded_tokens, info.computed_tokens, info.loaded_from)

See docs/engines.md.
"""

from __future__ import annotations

from engine_shim.client import TierTokens
from engine_shim.hf.cached_lm import CachedLM, Generation, Prefill, PrefillInfo
from engine_shim.hf.models import (
    kv_block_bytes,
    kv_geometry,
    llama3_8b,
    load_model,
    tiny_llama,
    weights_fingerprint,
)
from engine_shim.hf.paged import PagedKV

__all__ = [
    "CachedLM",
    "Generation",
    "PagedKV",
    "Prefill",
    "PrefillInfo",
    "TierTokens",
    "kv_block_bytes",
    "kv_geometry",
    "llama3_8b",
    "load_model",
    "tiny_llama",
    "weights_fingerprint",
]
