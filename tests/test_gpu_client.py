"""KVClient with CUDA tensors against a real sidecar (skipped without a GPU):
blocks saved from one engine's GPU KV cache load byte-exact into another's,
in vLLM's flash-attention layout, through the CUDA copy library."""

from __future__ import annotations

import numpy as np
import pytest
import sidecar_proc as sp
from sidecar_proc import Sidecar, tokens

torch = pytest.importorskip("torch")

from kv_helpers import why_no_gpu  # noqa: E402

from engine_shim import KVClient  # noqa: E402

pytestmark = pytest.mark.skipif(why_no_gpu() is not None, reason=str(why_no_gpu()))
LAYERS, BLOCKS, HEADS, DIM = 4, 32, 8, 128
TPB = sp.TOKENS_PER_BLOCK  # what `tokens` makes full blocks of


def flash_kv(seed: int | None) -> list[torch.Tensor]:
    """Per layer [2, num_blocks, tokens, kv_heads, head_dim] bf16 on the GPU."""
    shape = (2, BLOCKS, TPB, HEADS, DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)
    ]


def client_for(sidecar: Sidecar, kv: list[torch.Tensor]) -> KVClient:
    client = KVClient.connect(sidecar.endpoint, timeout=5.0)
    client.register(
        kv,
        layout="vllm_flash",
        model_name="gpu-test",
        model_revision="r1",
        tokens_per_block=TPB,
        num_kv_heads=HEADS,
        head_dim=DIM,
    )
    return client


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="64MiB").start()
    yield s
    assert s.stop() == 0
    assert s.shm_segments() == []
    s.cleanup()


@pytest.mark.parametrize("hot_path", [False, True], ids=["planned", "hot-path"])
def test_gpu_kv_saved_by_one_engine_loads_byte_exact_in_another(sidecar, hot_path):
    """Planned (the sidecar plans the load): it returns with its copies
    queued, layer by layer. Hot path (a CPU hit copied straight from the
    pool): the copy has landed and its slots' generations were checked
    before it returns."""
    source, target = flash_kv(1), flash_kv(None)
    rng = np.random.default_rng(0)
    saved_ids = rng.permutation(BLOCKS)[:9]
    loaded_ids = rng.permutation(BLOCKS)[:9]
    prompt = tokens(9, tail=3)
    with client_for(sidecar, source) as a, client_for(sidecar, target) as b:
        a.hot_path = b.hot_path = hot_path
        assert a.save(prompt, saved_ids).wait() == 9 * TPB
        assert b.lookup(prompt) == 9 * TPB
        handle = b.load(prompt, loaded_ids)
        assert handle.done is hot_path
        # Work queued on the engine's stream after wait_layer(i) sees layer i
        # landed, whatever later layers are doing.
        seen = []
        for layer in range(LAYERS):
            handle.wait_layer(layer)
            seen.append(target[layer][:, loaded_ids].clone())
        assert handle.wait() == 9 * TPB and handle.done
        torch.cuda.synchronize()
        for src, dst, early in zip(source, target, seen, strict=True):
            original = src[:, saved_ids].view(torch.int16)
            assert torch.equal(dst[:, loaded_ids].view(torch.int16), original)
            assert torch.equal(early.view(torch.int16), original)
        untouched = np.setdiff1d(np.arange(BLOCKS), loaded_ids)
        assert all(int(t[:, untouched].count_nonzero()) == 0 for t in target)
