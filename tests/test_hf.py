"""engine_shim.hf.CachedLM against a real sidecar: a prompt whose prefix is
loaded from the cache gives the same logits and greedy tokens as computing
it, and the tokens really came from the cache.

Fidelity: with a fixed schedule (`chunk_tokens`) the cached run must be bit
for bit the recompute (torch.equal), fp32 and bf16. Without one (one
forward for the suffix) CPU kernels round differently for different lengths;
measured against a one-shot forward over 120 prompts of 17-1,600 tokens
(tiny_llama, torch 2.13 CPU): max |diff| 8.6e-7 in fp32, 0.0078 in bf16
(one bf16 ulp at |logit| ~1, argmax always equal). The tolerances below
allow about 4x that.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
from hf_helpers import one_torch_thread  # noqa: F401
from sidecar_proc import Sidecar
from transformers import MistralConfig, MistralForCausalLM

from engine_shim import KVClient
from engine_shim.hf import CachedLM, TierTokens, load_model, tiny_llama, weights_fingerprint

FP32_TOL = 4e-6
BF16_TOL = 0.03125
NEW_TOKENS = 6
TPB = 16


def tokens(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g)


def full_blocks(n: int) -> int:
    return n // TPB * TPB


@pytest.fixture(scope="module")
def sidecar():
    sc = Sidecar(capacity="32MiB").start()
    yield sc
    assert sc.stop() == 0
    assert sc.shm_segments() == []
    sc.cleanup()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.fixture
def make_lm(request):
    """CachedLM(model, client of `sidecar`, ...) in a namespace of this test's own."""
    clients = []

    def make(sidecar, model, **kwargs) -> CachedLM:
        client = KVClient.connect(sidecar.endpoint, timeout=5.0)
        clients.append(client)
        kwargs.setdefault("model_revision", request.node.name)
        return CachedLM(model, client, max_tokens=2048, **kwargs)

    yield make
    for client in clients:
        client.close()


def exact_generation(lm: CachedLM, ids: torch.Tensor):
    """Generate with the cache, then recompute; both must agree bit for bit."""
    cached = lm.generate(ids, NEW_TOKENS)
    fresh = lm.generate(ids, NEW_TOKENS, use_sidecar=False)
    assert torch.equal(cached.logits, fresh.logits)
    assert torch.equal(cached.tokens, fresh.tokens)
    assert fresh.info.loaded_tokens == 0 and fresh.info.computed_tokens == ids.numel()
    info = cached.info
    assert info.loaded_tokens + info.computed_tokens == info.prompt_tokens == ids.numel()
    assert info.computed_tokens >= 1
    return cached


def test_multi_turn_chat_loads_earlier_turns_and_matches_a_recompute(sidecar, model, make_lm):
    lm = make_lm(sidecar, model, chunk_tokens=TPB)
    history = tokens(1, 150)  # system prompt + first user message: 9 blocks + 6 tokens
    previous = 0
    for turn in range(3):
        out = exact_generation(lm, history)
        info = out.info
        # The previous prompt's full blocks were saved; the reply's decode KV was not.
        assert info.loaded_tokens == full_blocks(previous)
        assert info.loaded_from == TierTokens(info.loaded_tokens, 0, 0)
        assert info.saved_tokens == full_blocks(history.numel())
        if turn:
            assert info.loaded_tokens > 0
        previous = history.numel()
        history = torch.cat([history, out.tokens, tokens(10 + turn, 40)])


def test_a_shared_system_prompt_is_loaded_by_another_conversation(sidecar, model, make_lm):
    lm = make_lm(sidecar, model, chunk_tokens=TPB)
    system = tokens(2, 200)  # 12 full blocks + 8 tokens
    first = exact_generation(lm, torch.cat([system, tokens(3, 37)]))
    assert first.info.loaded_tokens == 0
    second = exact_generation(lm, torch.cat([system, tokens(4, 53)]))
    assert second.info.loaded_tokens == 192  # block 12 mixes system and user tokens


@pytest.mark.parametrize("length", [128, 129, 133, 143])
def test_partial_tails_and_fully_cached_prompts_recompute_at_least_the_last_token(
    sidecar, model, make_lm, length
):
    lm = make_lm(sidecar, model, chunk_tokens=TPB)
    ids = tokens(5, length)
    assert exact_generation(lm, ids).info.loaded_tokens == 0
    again = exact_generation(lm, ids).info  # every full block is cached now
    assert again.cached_tokens == again.loaded_tokens == full_blocks(length - 1)
    assert again.computed_tokens == length - full_blocks(length - 1)  # 16 when block-aligned


def test_saves_and_loads_stop_on_the_chunk_schedule(sidecar, model, make_lm):
    lm = make_lm(sidecar, model, chunk_tokens=4 * TPB)
    ids = tokens(6, 150)
    # Blocks 8 (tokens 128..143) came from the last, shorter chunk: not saved.
    assert exact_generation(lm, ids).info.saved_tokens == 128
    info = exact_generation(lm, ids).info
    assert info.cached_tokens == info.loaded_tokens == 128
    assert info.computed_tokens == 22


def test_without_a_schedule_logits_are_within_rounding_of_a_one_shot_forward(
    sidecar, model, make_lm
):
    lm = make_lm(sidecar, model)
    history = tokens(7, 300)
    for turn in range(2):
        cached = lm.generate(history, NEW_TOKENS)
        with torch.no_grad():
            one_shot = model(history.unsqueeze(0)).logits[0, -1]
        assert (cached.logits - one_shot).abs().max().item() <= FP32_TOL
        assert torch.equal(
            cached.tokens, lm.generate(history, NEW_TOKENS, use_sidecar=False).tokens
        )
        assert (cached.info.loaded_tokens > 0) == (turn > 0)
        history = torch.cat([history, cached.tokens, tokens(8, 30)])


def test_bf16_is_exact_on_a_schedule_and_within_tolerance_without(make_lm):
    model = tiny_llama(0, dtype=torch.bfloat16)
    sc = Sidecar(capacity="16MiB").start()  # one sidecar per block layout
    try:
        exact = make_lm(sc, model, chunk_tokens=TPB, model_revision="bf16-exact")
        fast = make_lm(sc, model, model_revision="bf16-fast")
        history = tokens(9, 250)
        for turn in range(2):
            out = exact_generation(exact, history)
            assert out.info.loaded_tokens == (0 if turn == 0 else full_blocks(250))
            cached = fast.prefill(history)
            with torch.no_grad():
                one_shot = model(history.unsqueeze(0)).logits[0, -1]
            assert cached.logits.dtype == torch.bfloat16
            assert (cached.logits.float() - one_shot.float()).abs().max().item() <= BF16_TOL
            assert (cached.info.loaded_tokens > 0) == (turn > 0)
            history = torch.cat([history, out.tokens, tokens(10, 20)])
    finally:
        assert sc.stop() == 0
        sc.cleanup()


def test_blocks_evicted_to_ssd_load_from_there(tmp_path, model, make_lm):
    # 1 MiB of CPU tier holds 32 blocks of 32 KiB; every saved block is also written to SSD.
    sc = Sidecar(
        "--set", f"ssd_dirs={tmp_path}", "--set", "ssd_capacity_per_dir=8MiB", capacity="1MiB"
    ).start()
    try:
        lm = make_lm(sc, model, chunk_tokens=TPB)
        a, b = tokens(11, 400), tokens(12, 300)  # 25 and 18 blocks: A's tail leaves the CPU
        exact_generation(lm, a)
        exact_generation(lm, b)
        info = exact_generation(lm, a).info
        assert info.loaded_tokens == full_blocks(399)
        assert info.loaded_from.ssd > 0 and sum(info.loaded_from) == info.loaded_tokens
    finally:
        assert sc.stop() == 0
        sc.cleanup()


def test_a_stopped_sidecar_means_computing_everything(model):
    sc = Sidecar(capacity="16MiB").start()
    client = KVClient.connect(sc.endpoint, timeout=0.5)
    try:
        lm = CachedLM(model, client, chunk_tokens=TPB, max_tokens=512)
        ids = tokens(13, 100)
        assert lm.prefill(ids).info.saved_tokens == 96
        assert sc.stop() == 0
        logits, info = lm.prefill(ids)
        assert info.loaded_tokens == 0 and info.saved_tokens == 0
        assert torch.equal(logits, lm.prefill(ids, use_sidecar=False).logits)
    finally:
        client.close()
        sc.cleanup()


def test_models_with_sliding_window_layers_are_refused():
    config = MistralConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
    )
    with pytest.raises(ValueError, match="full-attention"):
        CachedLM(MistralForCausalLM(config), None)


def test_weights_fingerprint_names_the_weights_and_dtype(model):
    assert weights_fingerprint(model) == weights_fingerprint(tiny_llama(0))
    assert weights_fingerprint(model) != weights_fingerprint(tiny_llama(1))
    assert weights_fingerprint(model) != weights_fingerprint(tiny_llama(0, dtype=torch.bfloat16))


def test_load_model_reads_a_local_directory(tmp_path, model):
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = tokens(14, 40).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path / "missing")
