"""CachedLM with the model, and so its paged KV pool, on a CUDA GPU: blocks
move between GPU memory and the sidecar's shm through cuda_ext's GPU
copier. The fidelity checks of tests/test_hf.py on the GPU, and a tiny
`kvsidecar bench ttft --device cuda` with its SSD-tier hits.

Skipped where torch sees no CUDA GPU or libkvcopy.so cannot run (the
2-core development machine has none: expected there). The CPU side of
the same code (PagedKV on the model's device, CachedLM.connect,
split_recompute, the bench's flags) runs in tests/test_hf.py and
tests/test_bench_ttft.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import torch
from hf_helpers import tokens
from kv_helpers import why_no_gpu
from sidecar_proc import Sidecar

from engine_shim import KVClient
from engine_shim.hf import CachedLM, TierTokens, tiny_llama
from kvsidecar.cli import main

pytestmark = pytest.mark.skipif(why_no_gpu() is not None, reason=str(why_no_gpu()))
TPB = 16
BF16_TOL = 0.03125  # as in tests/test_hf.py


@pytest.fixture
def sidecar():
    """One per test: a sidecar serves one KV layout, and an fp32 and a bf16
    model's blocks differ in size."""
    sc = Sidecar(capacity="32MiB").start()
    yield sc
    assert sc.stop() == 0
    assert sc.shm_segments() == []
    sc.cleanup()


def cuda_lm(sidecar: Sidecar, dtype: torch.dtype, name: str, **kwargs: object) -> CachedLM:
    model = tiny_llama(0, dtype=dtype).to("cuda")
    client = KVClient.connect(sidecar.endpoint, timeout=5.0)
    return CachedLM(model, client, model_revision=name, max_tokens=2048, **kwargs)


def test_the_pool_is_in_gpu_memory_and_cached_turns_equal_a_recompute(sidecar):
    lm = cuda_lm(sidecar, torch.float32, "cuda-fp32", chunk_tokens=TPB)
    try:
        assert all(layer.is_cuda for layer in lm.pool.layers)
        assert type(lm.client._link.copier).__name__ == "GpuBlockCopier"
        history = tokens(1, 150)
        for turn in range(3):
            cached = lm.generate(history, 6)
            fresh = lm.generate(history, 6, use_sidecar=False)
            assert torch.equal(cached.logits, fresh.logits)
            assert torch.equal(cached.tokens, fresh.tokens)
            info = cached.info
            assert info.loaded_from == TierTokens(info.loaded_tokens, 0, 0)
            assert (info.loaded_tokens > 0) == (turn > 0)
            history = torch.cat([history, cached.tokens, tokens(10 + turn, 40)])
    finally:
        lm.client.close()


def test_a_hit_equals_the_split_recompute_and_bf16_is_within_tolerance(sidecar):
    lm = cuda_lm(sidecar, torch.bfloat16, "cuda-bf16")
    try:
        ids = tokens(2, 300)
        lm.prefill(ids[:256])
        hit = lm.prefill(ids, save=False)
        assert hit.info.loaded_tokens == 256 and hit.logits.is_cuda
        assert torch.equal(hit.logits, lm.split_recompute(ids, 256))
        one_shot = lm.prefill(ids, use_sidecar=False).logits
        assert (hit.logits.float() - one_shot.float()).abs().max().item() <= BF16_TOL
    finally:
        lm.client.close()


def test_bench_ttft_quick_on_cuda_loads_from_ssd_and_cpu(tmp_path):
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--quick", "--device", "cuda", "--dtype", "bf16"]
    assert main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["kv_pool_device"].startswith("cuda") and r["dtype"] == "bf16"
    assert r["all_from_ssd"] is True and r["all_from_cpu"] is True
    assert r["fidelity"]["ok"] is True
    assert r["sidecar_exit_codes"] == [0] * (r["repeats"] + 1) and r["shm_leftovers"] == []
