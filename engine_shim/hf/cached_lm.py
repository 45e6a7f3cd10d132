"""`CachedLM`: a transformers causal LM that uses kvsidecar as its prefix cache.

    lm = CachedLM(model, KVClient.connect())
    logits, info = lm.prefill(prompt_ids)         # load the cached prefix, compute the rest, save
    out = lm.generate(prompt_ids, max_new_tokens=32)

One prefill: `lookup` the prompt -> `load` the cached full blocks into the
paged pool -> a DynamicCache from those blocks -> forward over the uncached
suffix only, positions continuing after the prefix -> copy the prompt's new
full blocks from the model's cache into the pool -> `save` them. The sidecar
is an optimisation: when it is down, slow or refuses, the prompt is simply
computed (and a warning logged).

The prefill schedule (`chunk_tokens`):
- None (default): everything past the loaded prefix in one forward. Logits
  equal a one-shot recompute up to float rounding, not bit for bit: CPU and
  GPU kernels round differently for different sequence lengths (sdpa splits
  keys by length, matmuls pick kernels by row count). See docs/engines.md.
- an int S (a multiple of tokens_per_block): the prompt is computed in
  forwards over [0, S), [S, 2S), ... and loads stop on a multiple of S. A run
  that loads a prefix then runs exactly the forwards, on exactly the same
  inputs, that a recompute with the same S runs from there on, so its logits
  and KV are bit-identical to that recompute on any kernel. S =
  tokens_per_block reuses every cached block; a larger S recomputes faster.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from engine_shim.channel import SidecarError, SidecarUnavailable
from engine_shim.client import KVClient, TierTokens
from engine_shim.hf.models import kv_geometry, weights_fingerprint
from engine_shim.hf.paged import PagedKV, layer_kv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillInfo:
    prompt_tokens: int
    cached_tokens: int
    """What the sidecar's lookup said it holds: leading full-block tokens,
    short of the last token and within the pool."""
    loaded_tokens: int
    """Prefix tokens taken from the sidecar instead of computed."""
    computed_tokens: int
    loaded_from: TierTokens
    saved_tokens: int
    """Leading full-block tokens of the prompt the sidecar holds after this
    prefill's save (blocks it already had count); 0 when nothing was saved
    (no sidecar, or save=False)."""
    ttft_s: float
    """Start to last-token logits: lookup + load + build + forward (the save
    that follows is not on the first token's path)."""
    lookup_s: float
    load_s: float
    """The sidecar's load into the pool, waited for."""
    build_s: float
    """Building the forward's DynamicCache from the pool (`PagedKV.to_cache`;
    on a GPU, until its copies are queued)."""
    compute_s: float
    save_s: float


class Prefill(NamedTuple):
    logits: torch.Tensor
    """The last prompt token's logits, [vocab_size], in the model's dtype."""
    info: PrefillInfo


@dataclass(frozen=True)
class Generation:
    tokens: torch.Tensor
    """The new token ids, [max_new_tokens] (greedy)."""
    logits: torch.Tensor
    """The prompt's last-token logits (the first new token's distribution)."""
    info: PrefillInfo
    decode_s: float


class CachedLM:
    """A causal LM whose prompt prefixes are cached by a kvsidecar.

    `client` is a connected KVClient (or None: no cache at all). The pool
    holds `max_tokens` tokens of KV on the model's device (GPU memory for a
    model on CUDA: blocks then move between it and the sidecar's shm through
    cuda_ext's GPU copier, or torch's slower staged copies where
    libkvcopy.so cannot run); a longer prompt caches only its first
    `max_tokens`. Works for models whose every layer keeps the
    full-attention KV of all tokens in a DynamicCache (Llama, Mistral without
    sliding window, Qwen2, ...); others are refused at construction.
    `model_revision` names the weights in the cache namespace; by default a
    fingerprint of the config and weights (`weights_fingerprint`). The pool
    is registered with `client` here (and by `connect`): use one client per
    CachedLM (a client registered again by someone else since is refused
    with RuntimeError, as its copies would no longer reach this pool). A
    sidecar that refuses the layout raises SidecarError; one that is down
    only costs the cache until it answers.

    Only prompt KV computed by prefill is saved: decode computes a token's
    KV alone, which rounds differently from a prefill, so a next turn
    recomputes the generated tokens instead of loading them.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        client: KVClient | None,
        *,
        model_name: str | None = None,
        model_revision: str | None = None,
        tokens_per_block: int = 16,
        chunk_tokens: int | None = None,
        max_tokens: int = 8192,
    ) -> None:
        if chunk_tokens is not None and (chunk_tokens <= 0 or chunk_tokens % tokens_per_block):
            raise ValueError(
                f"chunk_tokens must be a multiple of tokens_per_block={tokens_per_block}"
            )
        if max_tokens < tokens_per_block:
            raise ValueError(f"max_tokens must hold at least one block of {tokens_per_block}")
        config = model.config.get_text_config(decoder=True)
        probe = DynamicCache(config=model.config)
        num_layers, num_kv_heads, head_dim = kv_geometry(model)
        if len(probe.layers) != num_layers or any(
            type(x) is not DynamicLayer for x in probe.layers
        ):
            raise ValueError(
                f"{type(model).__name__}: CachedLM needs full-attention KV in every layer "
                "(no sliding-window or linear-attention layers)"
            )
        _check_kv_shapes(model, probe, num_kv_heads, head_dim)
        self.model = model
        self.tokens_per_block = tokens_per_block
        self.chunk_tokens = chunk_tokens
        self.pool = PagedKV(
            num_layers=num_layers,
            num_blocks=max_tokens // tokens_per_block,
            tokens_per_block=tokens_per_block,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        self.model_name = model_name or Path(config.name_or_path or "").name or config.model_type
        self._revision = model_revision
        self.client: KVClient | None = None
        self._registration = 0
        self.connect(client)

    def connect(self, client: KVClient | None) -> None:
        """Use `client` (None: no cache) from now on, registering the pool
        with it: after a sidecar restart, a new client takes the old one's
        place. The caller closes the client it replaces."""
        self.client = client
        if client is None:
            return
        if self._revision is None:
            self._revision = weights_fingerprint(self.model)
        try:
            client.register(
                self.pool.layers,
                model_name=self.model_name,
                model_revision=self._revision,
                tokens_per_block=self.tokens_per_block,
                num_kv_heads=self.pool.num_kv_heads,
                head_dim=self.pool.head_dim,
                layout=PagedKV.LAYOUT,
            )
        except SidecarUnavailable as err:  # it registers by itself once one answers
            log.warning("no kvsidecar answers yet, computing every prompt: %s", err)
        self._registration = client.registration

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- prefill and generation -----------------------------------------------------

    def prefill(self, input_ids: Any, *, use_sidecar: bool = True, save: bool = True) -> Prefill:
        """The last token's logits for the prompt `input_ids` (1-D token ids),
        with the cached prefix loaded rather than computed. `use_sidecar=False`
        computes everything and saves nothing: the recompute baseline, with
        the same schedule. `save=False` loads but offers nothing new (a
        prompt not worth caching; a benchmark that repeats one hit)."""
        logits, info, _ = self._prefill(_as_ids(input_ids), use_sidecar, save)
        return Prefill(logits, info)

    def generate(
        self,
        input_ids: Any,
        max_new_tokens: int,
        *,
        use_sidecar: bool = True,
        save: bool = True,
    ) -> Generation:
        """Greedy decoding of `max_new_tokens` after a cached `prefill`."""
        ids = _as_ids(input_ids)
        logits, info, cache = self._prefill(ids, use_sidecar, save)
        start = time.perf_counter()
        new = []
        step_logits = logits
        with torch.no_grad():
            for i in range(max_new_tokens):
                token = int(torch.argmax(step_logits))
                new.append(token)
                if i + 1 == max_new_tokens:
                    break
                pos = ids.numel() + i
                out = self.model(
                    input_ids=torch.tensor([[token]], device=self.device),
                    past_key_values=cache,
                    position_ids=torch.tensor([[pos]], device=self.device),
                    use_cache=True,
                    logits_to_keep=1,
                )
                step_logits = out.logits[0, -1]
        _synchronize(self.device)
        tokens = torch.tensor(new, dtype=torch.long)
        return Generation(tokens, logits, info, time.perf_counter() - start)

    def split_recompute(self, input_ids: Any, split: int) -> torch.Tensor:
        """The last token's logits computed without the cache in the forwards
        a prefill that loaded `split` tokens runs: [0, split) (the forward
        that produced the loaded KV, if an earlier prompt of `split` tokens
        saved it), then [split, n). Its reference: a hit must equal it bit
        for bit on a deterministic device, whatever the kernels' rounding."""
        ids = _as_ids(input_ids)
        if not 0 < split < ids.numel():
            raise ValueError(f"split must be in [1, {ids.numel() - 1}], got {split}")
        cache = DynamicCache(config=self.model.config)
        self._forward(ids[:split], 0, cache)
        return self._forward(ids, split, cache)

    def _prefill(
        self, ids: torch.Tensor, use_sidecar: bool, save: bool
    ) -> tuple[torch.Tensor, PrefillInfo, DynamicCache]:
        client = self.client if use_sidecar else None
        if client is not None and client.registration != self._registration:
            raise RuntimeError(
                "this CachedLM's KVClient was registered again (by another CachedLM or "
                "engine) since it registered this pool: give each CachedLM its own client"
            )
        tpb = self.tokens_per_block
        n = ids.numel()
        ids_np = ids.numpy()
        start = time.perf_counter()

        # When every token hits the cache we must still compute the last one
        # to get its logits: load at most n - 1 tokens' worth of full blocks.
        limit = min(n - 1, self.pool.num_blocks * tpb) // tpb * tpb
        cached = TierTokens(0, 0, 0) if client is None else client.lookup_tiers(ids_np[:limit])
        lookup_done = time.perf_counter()
        loaded = self._load(client, ids_np, self._on_schedule(sum(cached)))
        load_done = time.perf_counter()
        cache = self.pool.to_cache(loaded // tpb, self.model.config)
        build_done = time.perf_counter()

        logits = self._forward(ids, loaded, cache)
        _synchronize(self.device)
        compute_done = time.perf_counter()

        saved = 0 if client is None or not save else self._save(client, ids_np, loaded, cache)
        info = PrefillInfo(
            prompt_tokens=n,
            cached_tokens=sum(cached),
            loaded_tokens=loaded,
            computed_tokens=n - loaded,
            loaded_from=_split(cached, loaded),
            saved_tokens=saved,
            ttft_s=compute_done - start,
            lookup_s=lookup_done - start,
            load_s=load_done - lookup_done,
            build_s=build_done - load_done,
            compute_s=compute_done - build_done,
            save_s=time.perf_counter() - compute_done,
        )
        return logits, info, cache

    def _on_schedule(self, tokens: int) -> int:
        """`tokens` rounded down to where the schedule lets a computation start."""
        step = self.chunk_tokens or self.tokens_per_block
        return tokens // step * step

    def _forward(self, ids: torch.Tensor, start: int, cache: DynamicCache) -> torch.Tensor:
        """Compute tokens [start, n) on top of `cache` (holding [0, start));
        the last token's logits."""
        n = ids.numel()
        step = self.chunk_tokens or n - start
        device = self.device
        with torch.no_grad():
            for a in range(start, n, step):
                end = min(a + step, n)
                out = self.model(
                    input_ids=ids[a:end].unsqueeze(0).to(device),
                    past_key_values=cache,
                    position_ids=torch.arange(a, end, device=device).unsqueeze(0),
                    use_cache=True,
                    logits_to_keep=1,
                )
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    # ---- the sidecar -------------------------------------------------------------------

    def _load(self, client: KVClient | None, ids: np.ndarray, tokens: int) -> int:
        """Load the first `tokens` of `ids` into pool blocks 0..; tokens loaded,
        on the schedule (fewer if blocks were evicted since the lookup)."""
        if client is None or tokens == 0:
            return 0
        try:
            # The forward starts only once the DynamicCache holds every layer,
            # so the whole load is waited for (wait_layer would overlap nothing);
            # for a CUDA pool wait() is also what lets the sidecar reuse the slots.
            loaded = client.load(ids[:tokens], np.arange(tokens // self.tokens_per_block)).wait()
        except (SidecarUnavailable, SidecarError) as err:
            log.warning("kvsidecar load failed, computing the prefix instead: %s", err)
            return 0
        return self._on_schedule(min(loaded, tokens))

    def _save(self, client: KVClient, ids: np.ndarray, loaded: int, cache: DynamicCache) -> int:
        """Offer the prompt's full blocks; the pool already holds the loaded ones.
        With a schedule, only blocks of whole chunks: a block that a shorter
        last chunk computed has other rounding than a recompute's full chunk."""
        tpb = self.tokens_per_block
        first, end = loaded // tpb, min(self._on_schedule(ids.size) // tpb, self.pool.num_blocks)
        if end <= first:
            return loaded
        self.pool.from_cache(cache, first, end)
        try:
            return client.save(ids[: end * tpb], np.arange(end)).wait()
        except (SidecarUnavailable, SidecarError) as err:
            log.warning("kvsidecar save failed, the prompt stays uncached: %s", err)
            return 0


def _check_kv_shapes(
    model: PreTrainedModel, cache: DynamicCache, num_kv_heads: int, head_dim: int
) -> None:
    """ValueError unless a one-token forward leaves K and V of
    [1, num_kv_heads, 1, head_dim] in every layer of `cache`, the shape the
    pool holds (MLA models, whose K and V head dims differ, do not)."""
    with torch.no_grad():
        model(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device),
            past_key_values=cache,
            use_cache=True,
        )
    want = (1, num_kv_heads, 1, head_dim)
    for i, layer in enumerate(cache.layers):
        keys, values = layer_kv(layer)
        got = {tuple(keys.shape), tuple(values.shape)}
        if got != {want}:
            raise ValueError(
                f"{type(model).__name__}: layer {i} keeps K/V of {sorted(got)} per token, "
                f"not {want} (num_kv_heads x head_dim from its config); CachedLM supports "
                "models whose K and V share one head shape (no MLA)"
            )


def _as_ids(input_ids: Any) -> torch.Tensor:
    """1-D int64 CPU token ids from a list, numpy array or tensor ([1, n] accepted)."""
    ids = torch.as_tensor(np.asarray(input_ids) if not torch.is_tensor(input_ids) else input_ids)
    if ids.numel() and (
        ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool
    ):
        raise TypeError(f"input_ids must be integer token ids, not {ids.dtype}")
    ids = ids.detach().to("cpu", torch.long)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("input_ids must be one non-empty sequence of token ids")
    return ids.contiguous()


def _split(cached: TierTokens, loaded: int) -> TierTokens:
    """Loaded tokens by tier: the sidecar serves the CPU prefix first, then SSD, then remote."""
    cpu = min(cached.cpu, loaded)
    ssd = min(cached.ssd, loaded - cpu)
    return TierTokens(cpu, ssd, loaded - cpu - ssd)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
