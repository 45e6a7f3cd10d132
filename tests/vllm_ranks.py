"""vLLM's scheduler in this process and each TP worker rank a process of its
own (spawned, vLLM's tensor-parallel group set up over gloo, as vLLM's CPU
workers do), all talking to one sidecar. Only the model's forward is
simulated: every rank writes, for every token it computes, KV that is a
function of (token, position, layer, rank), so a block loaded into the wrong
rank, position or layer is caught byte for byte.

Imports vLLM: only the tests that need it (they skip without it) import this.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sidecar_proc import DEADLINE, SPAWN, free_port
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK, HEADS, HEAD_DIM, LAYERS = 16, 2, 8, 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

Write = tuple[int, int, int, int]
"""(engine block, offset in it, token, position): one token's KV."""


def kv_value(token: int, pos: int, layer: int, rank: int, heads: int = HEADS) -> torch.Tensor:
    """One token's K and V on one rank, [heads, 2 * HEAD_DIM]: small integers, exact in fp32."""
    out = torch.arange(heads * 2 * HEAD_DIM, dtype=torch.float32).reshape(heads, -1)
    out = (out * 13 + token + pos * 7 + layer * 5 + rank * 3) % 65536
    out[0, :4] = torch.tensor([token, pos, layer, rank], dtype=torch.float32)
    return out


def configs(
    model_dir: Path,
    endpoint: str,
    *,
    tp: int,
    engine_id: str,
    num_blocks: int,
    mla: bool = False,
    **extra: Any,
) -> tuple[VllmConfig, KVCacheConfig]:
    """The same vLLM config in every process (one engine id). `mla`: one
    latent head of 2 * HEAD_DIM per token, the same on every rank."""
    model_dir.mkdir(exist_ok=True)
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64 * tp,
        "intermediate_size": 128,
        "num_attention_heads": 4 * tp,
        "num_key_value_heads": HEADS * tp,
        "num_hidden_layers": LAYERS,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    }
    (model_dir / "config.json").write_text(json.dumps(llama))
    transfer = KVTransferConfig(
        kv_connector="KVSidecarConnector",
        kv_connector_module_path="engine_shim.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        engine_id=engine_id,
        kv_connector_extra_config={"endpoint": endpoint, "timeout": 5.0, **extra},
    )
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=1024
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,  # prompts longer than that prefill in chunks
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    spec = (
        MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=2 * HEAD_DIM, dtype=torch.float32
        )
        if mla
        else FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)],
    )
    kv_cache_config.kv_cache_layout = "LBNHC"
    return config, kv_cache_config


def rank_main(conn: Any, rank: int, tp: int, port: int, args: dict[str, Any]) -> None:
    """One worker rank: vLLM's TP group, its connector, its KV; then steps
    as the scheduler sends them until told to stop."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    config, kv_cache_config = configs(tp=tp, **args)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        worker = KVConnectorFactory.create_connector(
            config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
        )
        heads = 1 if args.get("mla") else HEADS
        same = 0 if args.get("mla") else rank  # MLA: every rank holds the same KV
        shape = (args["num_blocks"], BLOCK, heads, 2 * HEAD_DIM)  # LBNHC memory
        kv = {name: torch.zeros(shape).permute(0, 2, 1, 3) for name in LAYER_NAMES}
        worker.register_kv_caches(kv)
        kv_transfer_state._KV_CONNECTOR_AGENT = worker
        conn.send("ready")
        try:
            while (msg := conn.recv()) is not None:
                out, writes, checks = msg
                worker.handle_preemptions(out.kv_connector_metadata)
                with (
                    set_forward_context(None, config),
                    KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output,
                ):
                    bad = []
                    hooks = worker.has_connector_metadata() and bool(writes or checks)
                    for layer, (name, t) in enumerate(kv.items()):  # as vLLM's attention layers
                        if hooks:
                            worker.wait_for_layer_load(name)
                        for block, off, token, pos in writes:
                            t[block, :, off] = kv_value(token, pos, layer, same, heads)
                        bad += [
                            (block, off, token, pos)
                            for block, off, token, pos in checks
                            if not torch.equal(
                                t[block, :, off], kv_value(token, pos, layer, same, heads)
                            )
                        ]
                        if hooks:
                            worker.save_kv_layer(name, t, None)
                conn.send((kv_output, bad))
        finally:
            kv_transfer_state.ensure_kv_transfer_shutdown()
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
            conn.close()


class TPEngine:
    """vLLM's scheduler here, `tp` worker ranks in processes of their own."""

    def __init__(
        self, tmp_path: Path, endpoint: str, *, tp: int, num_blocks: int = 64, **extra: Any
    ) -> None:
        args = {
            "model_dir": tmp_path / "tiny-llama",
            "endpoint": endpoint,
            "engine_id": f"tp-{uuid.uuid4().hex[:8]}",
            "num_blocks": num_blocks,
            **extra,
        }
        self.tp = tp
        config, kv_cache_config = configs(tp=tp, **args)
        port = free_port()
        self.ranks = []
        for rank in range(tp):
            here, there = SPAWN.Pipe()
            proc = SPAWN.Process(target=rank_main, args=(there, rank, tp, port, args))
            proc.start()
            there.close()
            self.ranks.append((proc, here))
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        for proc, conn in self.ranks:
            assert conn.poll(DEADLINE), f"rank process {proc.pid} did not start"
            assert conn.recv() == "ready"
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.block_tables: dict[str, list[int]] = {}
        self.computed: dict[str, set[int]] = {}
        self.checked: set[str] = set()
        """Requests whose whole prompt KV every rank checked byte for byte."""
        self.preempted: set[str] = set()
        self.resumed_at: dict[str, list[int]] = {}
        """Per preempted request: the position each resume started computing
        at (past 0: the rest was loaded from the sidecar)."""
        self.outputs: list[Any] = []

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        req = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(req)
        return req

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def step(self, before_forward: Callable[[Any], None] | None = None) -> Any:
        out = self.scheduler.schedule()
        if before_forward is not None:
            before_forward(out)
        writes, checks, sampled = self._forward(out)
        outputs = []
        for _, conn in self.ranks:
            conn.send((out, writes, checks))
        for proc, conn in self.ranks:
            assert conn.poll(DEADLINE), f"rank process {proc.pid} did not answer"
            kv_output, bad = conn.recv()
            assert not bad, f"KV differs from the simulated forward's at {bad[:4]}"
            outputs.append(
                ModelRunnerOutput(
                    req_ids=list(sampled),
                    req_id_to_index={r: i for i, r in enumerate(sampled)},
                    sampled_token_ids=[sampled[r] for r in sampled],
                    kv_connector_output=kv_output,
                )
            )
        merged = self.aggregator.aggregate(outputs)
        self.scheduler.update_from_output(out, merged)
        self.outputs.append((out, merged.kv_connector_output))
        return out, merged.kv_connector_output

    def _forward(self, out: Any) -> tuple[list[Write], list[Write], dict[str, list[int]]]:
        """The KV every rank writes, the prompts to check once written, the tokens sampled."""
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        for i, req_id in enumerate(cached.req_ids):
            starts[req_id] = cached.num_computed_tokens[i]
            if cached.new_block_ids[i] is not None:
                table = self.block_tables.setdefault(req_id, [])
                if req_id in cached.resumed_req_ids:
                    table.clear()
                table.extend(cached.new_block_ids[i][0])
        self.preempted |= set(out.preempted_req_ids or ())
        writes: list[Write] = []
        checks: list[Write] = []
        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start, table = starts[req_id], self.block_tables[req_id]
            for pos in range(start, start + n):
                writes.append((table[pos // BLOCK], pos % BLOCK, req.all_token_ids[pos], pos))
                self.computed.setdefault(req_id, set()).add(pos)
            done = start + n >= req.num_tokens
            sampled[req_id] = [7] if done else []
            if req_id in self.preempted:  # its first step since it resumed
                self.preempted.discard(req_id)
                self.resumed_at.setdefault(req_id, []).append(start)
                self.checked.discard(req_id)
            if done and req_id not in self.checked:  # (re)prefilled: check it all
                known = req.all_token_ids[: start + n]
                checks += [(table[p // BLOCK], p % BLOCK, t, p) for p, t in enumerate(known)]
                self.checked.add(req_id)
        return writes, checks, sampled

    def run(self, until: Callable[[], bool], before_forward: Any = None) -> None:
        deadline = time.monotonic() + DEADLINE
        while not until():
            self.step(before_forward)
            assert time.monotonic() < deadline, "the scheduler did not get there"
            time.sleep(0.002)  # let an asynchronous lookup land

    def finished(self, *req_ids: str) -> bool:
        return all(r not in self.scheduler.requests for r in req_ids)

    def close(self) -> None:
        try:
            self.scheduler.shutdown()
        finally:
            for _, conn in self.ranks:
                with contextlib.suppress(OSError):
                    conn.send(None)
            for proc, conn in self.ranks:
                proc.join(DEADLINE)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                conn.close()
