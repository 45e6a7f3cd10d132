"""The connector driven by vLLM's own classes: its scheduler
(`vllm.v1.core.sched.scheduler.Scheduler`, which creates the connector
through `KVConnectorFactory` from a `KVTransferConfig`), its `Request` with
vLLM's block hasher, and its worker-side connector lifecycle
(`KVConnectorModelRunnerMixin`: bind metadata, start_load_kv, wait_for_save,
get_transfer_results, get_block_ids_with_load_errors). Only the model's
forward is simulated: it writes, for every token it computes, KV that is a
function of (token, position, layer), so loaded blocks can be checked byte
for byte and told apart from recomputed ones.

Skipped where vLLM is not importable (CI installs no vLLM). Run it with a
vLLM 0.33 environment: docs/engines.md says how.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip(
    "vllm.v1.core.sched.scheduler", reason="vLLM is not installed here (see docs/engines.md)"
)

from sidecar_proc import DEADLINE, Sidecar
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
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import (
    KVConnectorModelRunnerMixin,
)

BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 16, 2, 8, 2, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(autouse=True)
def fixed_hash_seed(monkeypatch):
    """As a deployment that shares vLLM's block hashes sets it (docs/engines.md)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="4MiB").start()
    yield s
    s.cleanup()


class Engine:
    """vLLM's scheduler and worker-side connector around simulated KV."""

    def __init__(self, tmp_path, endpoint: str, **extra: object) -> None:
        model_dir = tmp_path / "tiny-llama"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
        transfer = KVTransferConfig(
            kv_connector="KVSidecarConnector",
            kv_connector_module_path="engine_shim.vllm_connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"endpoint": endpoint, "timeout": 2.0, **extra},
        )
        self.config = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=512
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=512,
                max_model_len=512,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what profiling would find
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)],
        )
        kv_cache_config.kv_cache_layout = "LBNHC"  # as vLLM's engine core resolves it
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
        )
        self.worker = KVConnectorFactory.create_connector(
            config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
        )
        # The worker's KV: per layer LBNHC memory, handed over as [B, H, N, C] views.
        self.kv = {
            name: torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM).permute(0, 2, 1, 3)
            for name in LAYER_NAMES
        }
        self.worker.register_kv_caches(self.kv)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # what the model runner uses
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.block_tables: dict[str, list[int]] = {}
        self.computed: dict[str, set[int]] = {}
        """Positions the simulated forward computed, per request."""

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Request:
        req = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(req)
        return req

    def step(self, before_forward=None, defer_finalize: bool = False):
        """One engine step; `defer_finalize`: as with speculative decoding,
        wait_for_save comes after the errors are read (a draft model's forward)."""
        out = self.scheduler.schedule()
        if before_forward is not None:
            before_forward(out)
        # As vLLM's GPU model runner does, before the inputs are prepared.
        self.worker.handle_preemptions(out.kv_connector_metadata)
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                table = self.block_tables.setdefault(req_id, [])
                if req_id in cached.resumed_req_ids:
                    table.clear()
                table.extend(cached.new_block_ids[i][0])
        with (
            set_forward_context(None, self.config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(
                out, defer_finalize=defer_finalize
            ) as kv_output,
        ):
            sampled = self._forward(out)
        if defer_finalize:
            KVConnectorModelRunnerMixin.finalize_kv_connector()
        runner_output = ModelRunnerOutput(
            req_ids=list(sampled),
            req_id_to_index={r: i for i, r in enumerate(sampled)},
            sampled_token_ids=[sampled[r] for r in sampled],
            kv_connector_output=kv_output,
        )
        self.scheduler.update_from_output(out, runner_output)
        return out, kv_output

    def _forward(self, out) -> dict[str, list[int]]:
        """Layer by layer, as vLLM's attention layers run the connector's
        per-layer hooks (`maybe_transfer_kv_layer`): wait for the layer's
        load, write its KV for every scheduled token, save it. Sample a
        token for requests whose prompt is then complete."""
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        hooks = self.worker.has_connector_metadata() and bool(out.num_scheduled_tokens)
        for layer, (name, t) in enumerate(self.kv.items()):
            if hooks:
                self.worker.wait_for_layer_load(name)
            for req_id, n in out.num_scheduled_tokens.items():
                req, table, start = (
                    self.scheduler.requests[req_id],
                    self.block_tables[req_id],
                    starts[req_id],
                )
                for pos in range(start, start + n):
                    t[table[pos // BLOCK], :, pos % BLOCK] = kv_value(
                        req.all_token_ids[pos], pos, layer
                    )
            if hooks:
                self.worker.save_kv_layer(name, t, None)
        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            start = starts[req_id]
            self.computed.setdefault(req_id, set()).update(range(start, start + n))
            done = start + n >= self.scheduler.requests[req_id].num_tokens
            sampled[req_id] = [7] if done else []
        return sampled

    def run(self, until, before_forward=None, **step) -> list:
        """Steps until `until()` holds (a step while an asynchronous lookup is
        in flight schedules nothing: as many as it takes, up to DEADLINE)."""
        outputs = []
        deadline = time.monotonic() + DEADLINE
        while True:
            outputs.append(self.step(before_forward, **step))
            if until():
                return outputs
            assert time.monotonic() < deadline, "the scheduler did not get there"
            time.sleep(0.002)  # let an asynchronous lookup land

    def assert_kv_of(self, req_id: str, tokens: list[int]) -> None:
        """The request's blocks hold the KV of exactly its tokens."""
        table = self.block_tables[req_id]
        for pos, token in enumerate(tokens):
            for layer, t in enumerate(self.kv.values()):
                got = t[table[pos // BLOCK], :, pos % BLOCK]
                assert torch.equal(got, kv_value(token, pos, layer)), (req_id, pos, layer)

    def close(self) -> None:
        self.scheduler.shutdown()
        kv_transfer_state.ensure_kv_transfer_shutdown()


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


def kv_value(token: int, pos: int, layer: int) -> torch.Tensor:
    """The simulated K and V of one token: [HEADS, 2 * HEAD_DIM]."""
    base = float(token * 1000 + pos) + layer / 4
    return base + torch.arange(HEADS * 2 * HEAD_DIM, dtype=torch.float32).reshape(HEADS, -1) / 64


@pytest.fixture
def engine(tmp_path, sidecar):
    e = Engine(tmp_path, sidecar.endpoint)
    yield e
    e.close()


def prompt(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 30_000 + 1 for i in range(n)]


def finished(engine: Engine, req_id: str) -> bool:
    return req_id not in engine.scheduler.requests


def test_the_connector_is_made_by_vllm(engine):
    from engine_shim import vllm_connector

    assert type(engine.scheduler.connector) is vllm_connector.KVSidecarConnector
    assert type(engine.worker) is vllm_connector.KVSidecarConnector
    assert engine.scheduler.connector._scheduler.use_block_hashes  # sha256, fixed seed


def test_auto_keys_by_tokens_without_a_fixed_hash_seed(tmp_path, sidecar, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED")  # vLLM's chains start from random bytes per process
    engine = Engine(tmp_path, sidecar.endpoint)
    try:
        assert not engine.scheduler.connector._scheduler.use_block_hashes
    finally:
        engine.close()


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"block_keys": "tokens"},
        {"load_async": False},
        {"layer_wise": True},
        {"layer_wise": True, "load_async": False},
    ],
    ids=["vllm-hashes-async", "token-keys", "sync-load", "layer-wise", "layer-wise-sync-load"],
)
def test_a_finished_request_is_saved_and_a_later_one_loads_it(tmp_path, sidecar, extra):
    engine = Engine(tmp_path, sidecar.endpoint, **extra)
    try:
        tokens = prompt(3 * BLOCK + 5)
        engine.add("a", tokens)
        steps = engine.run(lambda: finished(engine, "a"))
        # vLLM kept a's blocks until the worker reported the save.
        assert any("a" in (kv.finished_sending or ()) for _, kv in steps)
        engine.scheduler.reset_prefix_cache()  # vLLM's own cache forgets it: only kvsidecar has it

        engine.add("b", [*tokens, 99, 98])
        steps = engine.run(lambda: finished(engine, "b"))
        is_async = extra.get("load_async", True)
        assert any("b" in (kv.finished_recving or ()) for _, kv in steps) == is_async
        assert all(not kv.invalid_block_ids for _, kv in steps)
        # The 3 full blocks came from the sidecar, the rest was computed.
        assert min(engine.computed["b"]) == 3 * BLOCK
        engine.assert_kv_of("b", [*tokens, 99, 98])
    finally:
        engine.close()


def test_ask_again_while_the_lookup_is_in_flight(engine):
    tokens = prompt(2 * BLOCK + 1, start=500)
    engine.add("a", tokens)
    engine.run(lambda: finished(engine, "a"))
    engine.scheduler.reset_prefix_cache()
    engine.add("b", tokens)
    first, _ = engine.step()
    # (None, False): b waits for its lookup. Nothing scheduled alone would not
    # show it: a hit loaded asynchronously schedules no tokens either.
    assert first.total_num_scheduled_tokens == 0
    assert first.kv_connector_metadata.loads == ()
    assert engine.scheduler.requests["b"].status == RequestStatus.WAITING
    engine.run(lambda: finished(engine, "b"))
    assert min(engine.computed["b"]) == 2 * BLOCK
    engine.assert_kv_of("b", tokens)


def test_a_load_failure_is_recomputed_by_vllm(engine, sidecar):
    tokens = prompt(3 * BLOCK + 1, start=900)
    engine.add("a", tokens)
    engine.run(lambda: finished(engine, "a"))
    engine.scheduler.reset_prefix_cache()
    engine.add("b", tokens)

    def stop_before_the_load(out) -> None:
        # b's lookup hit: its load runs this step. A stopped sidecar withdraws
        # its hot index (a killed one's would serve its intact hits until its
        # stamp is stale), so the load asks it, and fails.
        if out.kv_connector_metadata.loads:
            sidecar.stop()

    steps = engine.run(lambda: finished(engine, "b"), before_forward=stop_before_the_load)
    assert sidecar.proc.poll() is not None
    assert any(kv.invalid_block_ids for _, kv in steps)
    assert min(engine.computed["b"]) == 0  # vLLM recomputed the blocks that failed
    engine.assert_kv_of("b", tokens)


def test_a_short_synchronous_load_is_reported_in_its_own_step(tmp_path, sidecar):
    """Speculative decoding defers wait_for_save past the read of the load
    errors: blocks evicted between lookup and load are still reported in the
    step whose forward they were missing from."""
    engine = Engine(tmp_path, sidecar.endpoint, load_async=False, block_keys="tokens")
    try:
        tokens = prompt(3 * BLOCK + 1, start=1700)
        engine.add("a", tokens)
        engine.run(lambda: finished(engine, "a"), defer_finalize=True)
        engine.scheduler.reset_prefix_cache()
        engine.add("b", tokens)
        client = engine.scheduler.connector._scheduler._client

        def evict_before_the_load(out) -> None:
            if out.kv_connector_metadata.loads:
                assert client.delete(tokens[: 2 * BLOCK]) == 2  # blocks 1 and 2 go

        steps = engine.run(
            lambda: finished(engine, "b"), before_forward=evict_before_the_load, defer_finalize=True
        )
        (load_step,) = [kv for out, kv in steps if out.kv_connector_metadata.loads]
        table = engine.block_tables["b"]
        assert load_step.invalid_block_ids == {table[1], table[2]}
        assert all(not kv.invalid_block_ids for _, kv in steps if kv is not load_step)
        assert min(engine.computed["b"]) == BLOCK
        engine.assert_kv_of("b", tokens)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "extra",
    [{"load_async": False}, {"load_async": False, "layer_wise": True}, {}],
    ids=["sync", "sync-layer-wise", "async"],
)
def test_blocks_a_short_load_left_unloaded_never_reach_the_sidecar(tmp_path, sidecar, extra):
    """b hits a's 3 blocks and computes 2 more; blocks 1 and 2 are evicted
    before its load. vLLM recomputes them, and what the sidecar keeps of b
    is what b's forward wrote over its real tokens: c, with b's prefix,
    loads it and gets the KV of its tokens (before, a synchronous load's
    step saved the engine blocks that never loaded)."""
    engine = Engine(tmp_path, sidecar.endpoint, block_keys="tokens", **extra)
    try:
        base = prompt(3 * BLOCK + 1, start=1700)
        engine.add("a", base)
        engine.run(lambda: finished(engine, "a"))
        engine.scheduler.reset_prefix_cache()
        longer = [*base[: 3 * BLOCK], *prompt(2 * BLOCK + 1, start=9000)]
        engine.add("b", longer)
        client = engine.scheduler.connector._scheduler._client

        def evict_before_the_load(out) -> None:
            if out.kv_connector_metadata.loads:
                assert client.delete(base[: 2 * BLOCK]) == 2  # blocks 1 and 2 go

        engine.run(lambda: finished(engine, "b"), before_forward=evict_before_the_load)
        engine.assert_kv_of("b", longer)
        engine.worker._worker.drain()
        engine.scheduler.reset_prefix_cache()
        engine.add("c", [*longer, 5, 6])
        engine.run(lambda: finished(engine, "c"))
        assert min(engine.computed["c"]) == 5 * BLOCK  # every block of b's loaded
        engine.assert_kv_of("c", [*longer, 5, 6])
    finally:
        engine.close()


def test_a_resumed_request_aborted_while_it_loads_is_freed_once(tmp_path, sidecar):
    """a offered saves, was preempted, resumed with a load of its own
    blocks, and is aborted while that load runs: vLLM keeps its blocks for
    the load alone (before, the connector asked it to keep them for the
    saves too, and the second report failed vLLM's check)."""
    engine = Engine(tmp_path, sidecar.endpoint)
    try:
        engine.add("a", prompt(3 * BLOCK + 5, start=300), max_tokens=40)
        engine.step()
        engine.step()
        engine.worker._worker.drain()
        scheduler = engine.scheduler
        scheduler.reset_prefix_cache(reset_running_requests=True)  # a is preempted
        aborted = []

        def abort_while_it_loads(out) -> None:
            if out.kv_connector_metadata.loads and not aborted:
                assert scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
                scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
                aborted.append(True)

        engine.run(lambda: bool(aborted) and finished(engine, "a"), abort_while_it_loads)
        engine.worker._worker.drain()
        for _ in range(3):  # a report for the freed request would fail vLLM's check here
            engine.step()
    finally:
        engine.close()


def test_a_hybrid_model_is_refused_naming_the_group(engine):
    """Full attention beside a sliding-window group (vLLM's hybrid manager
    on): refused when vLLM makes the connector, naming the group."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    window = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        dtype=torch.float32,
        sliding_window=64,
    )
    hybrid = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(LAYER_NAMES[:1], full),
            KVCacheGroupSpec(LAYER_NAMES[1:], window),
        ],
    )
    with pytest.raises(ValueError, match=r"group 1 \(SlidingWindowSpec, layers model.layers.1"):
        KVConnectorFactory.create_connector(
            config=engine.config, role=KVConnectorRole.WORKER, kv_cache_config=hybrid
        )


def test_a_bad_extra_config_key_stops_vllm_naming_it(tmp_path, sidecar):
    with pytest.raises(ValueError, match="load_asynch"):
        Engine(tmp_path, sidecar.endpoint, load_asynch=True)
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0, 3600"):
        Engine(tmp_path, sidecar.endpoint, timeout=-1)
