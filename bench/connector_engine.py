"""The engine loop `bench connector` times: vLLM's own `Scheduler` (which
makes the connector through `KVConnectorFactory`), the worker-side
connector lifecycle of `KVConnectorModelRunnerMixin`, and a simulated
forward of fixed length (it sleeps, the CPU idle as during a GPU forward;
the KV it "computes" is whatever the blocks hold). With the KV on a GPU
(`device="cuda"`) each layer's write is a small kernel on the current
stream, which the step waits for at its end as vLLM does to read the
sampled tokens; the GPU is otherwise idle, so the connector's copies do not
compete with a model's kernels.
The same loop with no `kv_transfer_config` is the baseline.

Needs vLLM (its side environment); imported only by `bench.connector` there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin


@dataclass(frozen=True)
class Shape:
    """The simulated model's KV: per rank, fp16."""

    layers: int = 4
    heads: int = 8
    head_dim: int = 64
    block: int = 16
    num_blocks: int = 640
    max_batched_tokens: int = 2048
    max_seqs: int = 64

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer."""
        return self.layers * self.block * self.heads * 2 * self.head_dim * 2


@dataclass(frozen=True)
class StepTime:
    scheduler_s: float
    """schedule() + update_from_output()."""
    worker_s: float
    """The connector's hooks around the forward (bind, start_load_kv,
    handle_preemptions, wait_for_save, get_finished, errors) and inside it
    (each layer's wait_for_layer_load and save_kv_layer)."""
    total_s: float
    loads: int
    saves: int
    """Blocks the step's metadata loads and newly offers for saving."""


class BenchEngine:
    def __init__(
        self,
        workdir: Path,
        shape: Shape,
        forward_s: float,
        endpoint: str | None,
        device: str,
        **extra: Any,
    ) -> None:
        """`endpoint` None: no connector (the baseline). `device`: where the
        KV cache lives ("cpu" or "cuda"); vLLM's own config says CPU either
        way (only its scheduler and the connector run here, and the
        connector follows the tensors)."""
        self.shape, self.forward_s, self.device = shape, forward_s, torch.device(device)
        model_dir = workdir / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(_llama(shape)))
        transfer = None
        if endpoint is not None:
            transfer = KVTransferConfig(
                kv_connector="KVSidecarConnector",
                kv_connector_module_path="engine_shim.vllm_connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"endpoint": endpoint, "timeout": 5.0, **extra},
            )
        config = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=4096
            ),
            cache_config=CacheConfig(block_size=shape.block, enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(
                max_num_seqs=shape.max_seqs,
                max_num_batched_tokens=shape.max_batched_tokens,
                max_model_len=4096,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = shape.num_blocks
        spec = FullAttentionSpec(
            block_size=shape.block,
            num_kv_heads=shape.heads,
            head_size=shape.head_dim,
            dtype=torch.float16,
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
        kv_config = KVCacheConfig(shape.num_blocks, [], [KVCacheGroupSpec(names, spec)])
        kv_config.kv_cache_layout = "LBNHC"
        self.config = config
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=shape.block,
        )
        memory = (shape.num_blocks, shape.block, shape.heads, 2 * shape.head_dim)
        self.kv = {  # every page touched
            n: torch.ones(memory, dtype=torch.float16, device=self.device) for n in names
        }
        self.worker = None
        if endpoint is not None:
            self.worker = KVConnectorFactory.create_connector(
                config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_config
            )
            self.views = {n: t.permute(0, 2, 1, 3) for n, t in self.kv.items()}
            self.worker.register_kv_caches(self.views)
            kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.tables: dict[str, list[int]] = {}

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=tokens,
                sampling_params=params,
                pooling_params=None,
            )
        )

    def step(self) -> StepTime:
        started = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        meta = out.kv_connector_metadata
        if self.worker is None:
            sampled, _ = self._forward(out)
            worker_s, kv_output = 0.0, None
        else:
            kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # several engines: this one's
            self.worker.handle_preemptions(meta)
            with (
                set_forward_context(None, self.config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output,
            ):
                forward_at = time.perf_counter()
                sampled, hooks_s = self._forward(out)
                forward_end = time.perf_counter()
            worker_s = (forward_at - scheduled) + (time.perf_counter() - forward_end) + hooks_s
        before_update = time.perf_counter()
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=list(sampled),
                req_id_to_index={r: i for i, r in enumerate(sampled)},
                sampled_token_ids=[sampled[r] for r in sampled],
                kv_connector_output=kv_output,
            ),
        )
        ended = time.perf_counter()
        loads = sum(s.num_blocks - s.skip_blocks for s in meta.loads) if meta else 0
        saves = sum(s.new_blocks for s in meta.saves) if meta else 0
        return StepTime(
            (scheduled - started) + (ended - before_update), worker_s, ended - started, loads, saves
        )

    def _forward(self, out: Any) -> tuple[dict[str, list[int]], float]:
        """(the tokens sampled, seconds in the per-layer hooks). Layer by
        layer as vLLM's attention layers run the connector's hooks: wait for
        the layer's load, compute it (sleep out forward_s / layers from when
        it could start: a GPU's fixed time per layer), save it."""
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        for i, req_id in enumerate(cached.req_ids):
            starts[req_id] = cached.num_computed_tokens[i]
            if cached.new_block_ids[i] is not None:
                table = self.tables.setdefault(req_id, [])
                if req_id in cached.resumed_req_ids:
                    table.clear()
                table.extend(cached.new_block_ids[i][0])
        block, per_layer = self.shape.block, self.forward_s / len(self.kv)
        hooks = self.worker is not None and bool(out.num_scheduled_tokens)
        hooks_s = 0.0
        for name, t in self.kv.items():
            if hooks:
                waited = time.perf_counter()
                self.worker.wait_for_layer_load(name)
                hooks_s += time.perf_counter() - waited
            layer_at = time.perf_counter()
            for req_id, start in starts.items():  # one token's KV: the time is the sleep's
                if req_id in out.num_scheduled_tokens:
                    t[self.tables[req_id][start // block], start % block] = float(start)
            left = per_layer - (time.perf_counter() - layer_at)
            if left > 0:
                time.sleep(left)
            if hooks:
                saved = time.perf_counter()
                self.worker.save_kv_layer(name, self.views[name], None)
                hooks_s += time.perf_counter() - saved
        if self.device.type == "cuda":  # vLLM waits for the forward's stream to read the tokens
            torch.cuda.current_stream(self.device).synchronize()
        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            done = starts[req_id] + n >= self.scheduler.requests[req_id].num_tokens
            sampled[req_id] = [7] if done else []
        return sampled, hooks_s

    def settle(self) -> None:
        """Let this engine's queued transfers end (untimed), so that they do
        not run beside the next engine's timed step."""
        if self.worker is not None:
            self.worker._worker.drain()

    def idle(self) -> bool:
        return not self.scheduler.requests

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.worker is not None:
            kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # what is shut down
            kv_transfer_state.ensure_kv_transfer_shutdown()


def _llama(shape: Shape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.heads * shape.head_dim,
        "intermediate_size": 256,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }
