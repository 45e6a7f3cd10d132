"""Models for the HF adapter: random-weight Llamas built locally (a tiny one
for tests, one of Llama-3-8B's geometry for GPU benchmarks), a model loaded
from a local directory, and a fingerprint of a model's weights.

Nothing here downloads: `load_model` reads only local files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
import xxhash
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

# A 4-layer Llama with grouped-query attention (8 query heads share 2 KV
# heads): 2.7M parameters, a 32 KiB KV block of 16 tokens in fp32.
TINY_LLAMA = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
}


# Llama-3-8B's geometry (8.03B parameters; a KV block of 16 tokens is 2 MiB
# in bf16). Random weights: for timing and fidelity, not for text.
LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def tiny_llama(
    seed: int = 0, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> LlamaForCausalLM:
    """The small test model: random weights drawn from `seed` (the same seed
    gives the same bytes on every run), in eval mode, on the CPU. The global
    torch RNG is left as it was."""
    config = _llama_config(TINY_LLAMA, attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return cast(LlamaForCausalLM, model.to(dtype).eval())  # type: ignore[arg-type]


def llama3_8b(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    attn_implementation: str = "sdpa",
) -> LlamaForCausalLM:
    """A random-weight Llama with Llama-3-8B's geometry, drawn from `seed`
    straight on `device` in `dtype` (16 GB in bf16): nothing is downloaded
    and no fp32 copy is made. Building it on "cpu" takes that much RAM and
    minutes; "meta" builds only the shapes. The global torch RNG (and the
    device's) is left as it was."""
    device = torch.device(device)
    config = _llama_config(LLAMA3_8B, attn_implementation)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = LlamaForCausalLM._from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    return cast(LlamaForCausalLM, model.eval())


def load_model(
    path: str | Path, *, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A causal LM from a local directory (config.json + weights), never the hub."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no config.json: pass a local model directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return cast(PreTrainedModel, model.to(device).eval())  # type: ignore[arg-type]


def _llama_config(geometry: dict[str, Any], attn_implementation: str) -> LlamaConfig:
    return LlamaConfig(**{**geometry, "attn_implementation": attn_implementation})


def kv_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder's KV cache, from its config."""
    config = model.config.get_text_config(decoder=True)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def kv_block_bytes(model: PreTrainedModel, tokens_per_block: int = 16) -> int:
    """Bytes of one KV block (keys and values of every layer), in the model's dtype."""
    num_layers, num_kv_heads, head_dim = kv_geometry(model)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return num_layers * 2 * tokens_per_block * num_kv_heads * head_dim * itemsize


def weights_fingerprint(model: torch.nn.Module) -> str:
    """xxh3-128 over the model's config and every parameter and buffer (name,
    dtype, shape, bytes): two models give the same fingerprint only if they
    compute the same KV. xxh3 over the bytes in place: 28 GB/s measured."""
    h = xxhash.xxh3_128()
    config = getattr(model, "config", None)
    if config is not None:
        settings = config.to_dict()
        settings.pop("_name_or_path", None)  # where it was loaded from changes no KV
        h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            h.update(data.view(torch.uint8).numpy())
    return h.hexdigest()
