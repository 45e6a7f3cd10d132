"""Fidelity where SGLang's model runner cannot run (no CUDA): the project's
tiny Llama's KV of a prompt goes into SGLang's host pool, through the
backend and a real sidecar into another engine process's host pool, and
the logits computed there on the reloaded pages equal, bit for bit, those
computed here on the KV the prompt's prefill made.

Skipped where SGLang is not importable (run it with
`python -m sideenv run sglang -- python -m pytest tests/test_sglang_fidelity.py`).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed here (docs/engines.md)"
)

from collections.abc import Iterator

import torch
from hf_helpers import tokens
from sglang.srt.mem_cache.utils import get_hash_str
from sglang_helpers import backend, continue_from_storage, info, put_cache, tiny_llama_pool
from sidecar_proc import SPAWN, Sidecar

from engine_shim.hf.models import tiny_llama

PAGE, PAGES = 8, 6


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    s = Sidecar(capacity="16MiB").start()
    try:
        yield s
        assert s.stop() == 0
    finally:
        s.cleanup()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_reloaded_pages_give_the_prefills_logits_bit_for_bit(sidecar: Sidecar, layout: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other process computes with one thread too
    try:
        model = tiny_llama(0)
        ids = tokens(3, PAGES * PAGE + 5)
        prompt, rest = ids[: PAGES * PAGE], ids[PAGES * PAGE :]
        keys = list(get_hash_str(prompt.tolist(), None, page_size=PAGE))
        pool = tiny_llama_pool(model, layout, PAGE)
        where = pool.alloc(PAGES * PAGE)
        with torch.no_grad():
            cache = model(prompt[None], use_cache=True).past_key_values
            put_cache(pool, cache, where)
            expected = model(rest[None], past_key_values=cache).logits
    finally:
        torch.set_num_threads(threads)
    store = backend(pool, sidecar.endpoint)
    try:
        half = PAGES // 2 * PAGE
        assert store.batch_set_v1(keys[: PAGES // 2], where[:half], info([])) == [True] * 3
        assert store.batch_set_v1(keys[PAGES // 2 :], where[half:], info(keys[:3])) == [True] * 3
    finally:
        store.close()
    with SPAWN.Pool(1) as other:
        got, logits = other.apply(
            continue_from_storage, (sidecar.endpoint, layout, PAGE, keys, rest)
        )
    assert got == [True] * PAGES
    assert logits.shape == expected.shape and torch.equal(logits, expected)
