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
from hf_helpers import tokens
from sidecar_proc import Sidecar, wait_for
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from engine_shim import KVClient
from engine_shim.hf import (
    CachedLM,
    PagedKV,
    TierTokens,
    kv_block_bytes,
    kv_geometry,
    llama3_8b,
    load_model,
    tiny_llama,
    weights_fingerprint,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP32_TOL = 4e-6
BF16_TOL = 0.03125
NEW_TOKENS = 6
TPB = 16


@pytest.fixture(scope="module")
def sidecar():
    sc = Sidecar(capacity="32MiB").start()
    yield sc
    assert sc.stop() == 0
    assert sc.shm_segments() == []
    sc.cleanup()


def full_blocks(n: int) -> int:
    return n // TPB * TPB


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


def test_models_whose_k_and_v_heads_differ_are_refused():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(  # MLA: K head dim 24 (16 + rope 8), V head dim 16
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
    )
    with pytest.raises(ValueError, match="no MLA"):
        CachedLM(DeepseekV3ForCausalLM(config), None)


def test_a_client_registered_again_by_another_cached_lm_is_refused(sidecar, model, make_lm):
    first = make_lm(sidecar, model, chunk_tokens=TPB)
    ids = tokens(7, 40)
    first.prefill(ids)
    other = CachedLM(tiny_llama(1), first.client, model_revision="other", max_tokens=2048)
    with pytest.raises(RuntimeError, match="registered again"):
        first.prefill(ids)  # its copies would now go to `other`'s pool
    assert other.prefill(ids).info.prompt_tokens == 40
    assert first.prefill(ids, use_sidecar=False).info.loaded_tokens == 0


def test_token_ids_must_be_integers(model):
    lm = CachedLM(model, None)
    for bad in ([1.9, 2.7], torch.tensor([True, False]), torch.ones(3)):
        with pytest.raises(TypeError, match="integer token ids"):
            lm.prefill(bad)
    with pytest.raises(ValueError, match="non-empty"):
        lm.prefill([])


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


def test_a_hit_is_bit_identical_to_the_split_recompute_without_a_schedule(sidecar, model, make_lm):
    # What bench ttft checks every hit against: the forwards its loaded KV came from.
    lm = make_lm(sidecar, model)
    assert lm.pool.device == model.device and lm.pool.layers[0].device.type == "cpu"
    for length, prefix in ((300, 192), (1000, 640), (129, 128)):
        ids = tokens(15 + length, length)
        assert lm.prefill(ids[:prefix]).info.saved_tokens == prefix
        hit = lm.prefill(ids, save=False)
        assert hit.info.loaded_tokens == prefix and hit.info.saved_tokens == 0
        assert torch.equal(hit.logits, lm.split_recompute(ids, prefix))
    with pytest.raises(ValueError, match="split must be in"):
        lm.split_recompute(ids, 129)


def test_connect_swaps_the_client_after_a_sidecar_restart(model):
    lm = CachedLM(model, None, chunk_tokens=TPB, max_tokens=512, model_revision="swap")
    ids = tokens(16, 100)
    assert lm.prefill(ids).info.saved_tokens == 0  # no client: nothing cached
    for _ in range(2):  # each life: a new sidecar, a new client, registered by connect
        sc = Sidecar(capacity="16MiB").start()
        client = KVClient.connect(sc.endpoint, timeout=5.0)
        try:
            lm.connect(client)
            assert lm.prefill(ids).info.loaded_tokens == 0  # a new sidecar holds nothing
            assert lm.prefill(ids).info.loaded_tokens == 96
            lm.connect(None)
            assert lm.prefill(ids).info.loaded_tokens == 0
        finally:
            client.close()
            assert sc.stop() == 0
            sc.cleanup()


def test_paged_kv_refuses_bad_shapes_and_block_ranges(model):
    with pytest.raises(ValueError, match="at least one layer"):
        PagedKV(
            num_layers=2, num_blocks=0, tokens_per_block=16, num_kv_heads=2, head_dim=8,
            dtype=torch.float32,
        )  # fmt: skip
    pool = PagedKV(
        num_layers=4, num_blocks=4, tokens_per_block=16, num_kv_heads=2, head_dim=32,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    assert pool.device == torch.device("cpu") and pool.block_bytes == kv_block_bytes(model)
    with pytest.raises(ValueError, match="num_blocks must be in"):
        pool.to_cache(5, model.config)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.from_cache(pool.to_cache(4, model.config), 2, 6)


def test_to_cache_equals_a_cache_filled_through_update_and_grows_like_one(model):
    """`to_cache` fills DynamicLayers with views of the pool: the same keys
    and values as `DynamicCache.update` of the blocks' tokens in order, the
    same length, and a forward on top of either gives the same logits bit
    for bit, leaving the pool as it was."""
    pool = PagedKV(
        num_layers=4, num_blocks=6, tokens_per_block=16, num_kv_heads=2, head_dim=32,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    for layer in pool.layers:  # what the sidecar's copies write: [block, K/V, head, token, dim]
        layer.copy_(torch.randn(layer.shape, generator=generator))
    made = pool.to_cache(5, model.config)
    reference = DynamicCache(config=model.config)
    for i, layer in enumerate(pool.layers):
        kv = torch.stack(  # token j * 16 + t of the cache is token t of block j
            [
                torch.stack([torch.cat(list(layer[:5, side, head])) for head in range(2)])
                for side in range(2)
            ]
        )
        reference.update(kv[0].unsqueeze(0), kv[1].unsqueeze(0), i)
    assert made.get_seq_length() == reference.get_seq_length() == 80
    assert len(made.layers) == len(reference.layers) == 4
    for got, want in zip(made.layers, reference.layers, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert type(got) is type(want) and got.is_initialized and want.is_initialized
        assert (got.dtype, got.device) == (want.dtype, want.device)
    ids = torch.arange(80, 83).unsqueeze(0)
    with torch.no_grad():
        logits = [
            model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            for cache in (made, reference)
        ]
    assert torch.equal(logits[0], logits[1])
    assert made.get_seq_length() == 83 and pool.to_cache(0, model.config).get_seq_length() == 0
    for layer, cached in zip(pool.layers, reference.layers, strict=True):
        assert torch.equal(layer[:5, 0, 1, 3], cached.keys[0, 1, :80][3::16])  # pool untouched


def test_llama3_8b_has_the_geometry_of_llama_3_8b():
    model = llama3_8b(0, device="meta")  # shapes only: no 16 GB on the CPU
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert kv_geometry(model) == (32, 8, 128)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 128256
    assert model.config.intermediate_size == 14336
    assert kv_block_bytes(model) == 2 << 20


def test_a_hit_from_ssd_after_a_restart_equals_the_split_recompute(tmp_path, model):
    # What bench ttft's SSD rows rest on: saved with write-through, the sidecar
    # restarted on the same directory (CPU tier empty), the prefix loaded from SSD.
    sc = Sidecar(
        "--set", f"ssd_dirs={tmp_path}", "--set", "ssd_capacity_per_dir=8MiB", capacity="16MiB"
    )
    lm = CachedLM(model, None, max_tokens=1024, model_revision="ssd-restart")
    ids = tokens(17, 500)
    try:
        for life in range(2):
            sc.start()
            client = KVClient.connect(sc.endpoint, timeout=5.0)
            lm.connect(client)
            if life == 0:
                assert lm.prefill(ids[:480]).info.saved_tokens == 480
                wait_for(lambda c=client: _all_on_ssd(c, 30))  # the SSD writes landed
            else:
                hit = lm.prefill(ids, save=False)
                assert hit.info.loaded_from == TierTokens(0, 480, 0)
                assert torch.equal(hit.logits, lm.split_recompute(ids, 480))
                again = lm.prefill(ids, save=False)  # staged into the CPU tier by the first
                assert again.info.loaded_from == TierTokens(480, 0, 0)
                assert torch.equal(again.logits, hit.logits)
            lm.connect(None)
            client.close()
            assert sc.stop() == 0
    finally:
        sc.cleanup()


def _all_on_ssd(client: KVClient, blocks: int) -> bool:
    stats = client.stats()
    return stats["plans_in_flight"] == 0 and stats["tiers"]["ssd"]["cached_blocks"] == blocks
