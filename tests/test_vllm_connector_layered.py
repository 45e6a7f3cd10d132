"""Layer-wise transfers (`layer_wise`: engine_shim.kvconnector.layered)
through the connector's worker half against a real sidecar process: a
simulated forward computes the KV layer by layer and calls the per-layer
hooks as vLLM's attention layers do (`wait_for_layer_load` before a layer,
`save_kv_layer` after it). Every loaded block is checked byte for byte."""

from __future__ import annotations

import dataclasses
import signal

import numpy as np
import pytest
import torch
from sidecar_proc import Sidecar
from test_vllm_connector import cached, finished_eventually
from vllm_helpers import (
    BLOCK,
    GEOMETRY,
    HEAD_DIM,
    HEADS,
    NUM_BLOCKS,
    StepOutput,
    blocks_of,
    halves,
    kv_caches,
    prompt,
    request,
    scheduler_side,
    settings,
    tables_of,
)

import engine_shim.vllm_connector as glue
from engine_shim.kvconnector.layered import StepSaves, load_stop, save_stop
from engine_shim.kvconnector.metadata import ConnectorMeta
from engine_shim.kvconnector.settings import ConnectorSettings
from engine_shim.kvconnector.worker import WorkerSide


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="4MiB").start()
    yield s
    try:
        if s.proc is not None and s.proc.poll() is None:  # not killed by the test
            assert s.stop() == 0
            assert s.shm_segments() == [], "shm segments outlived the sidecar"
    finally:
        s.cleanup()


@pytest.fixture
def make_pair(sidecar):
    made = []

    def make(seed: int = 1, **overrides):
        kv = kv_caches(seed=seed)
        sched, worker = halves(sidecar.endpoint, kv, **overrides)
        made.extend((sched, worker))
        return sched, worker, kv

    yield make
    for side in made:
        side.close()


def forward(worker: WorkerSide, meta: ConnectorMeta, kv, compute=None, after_layer=None) -> None:
    """A forward as vLLM runs it: per layer in order, wait for its load,
    compute it (`compute(name, tensor)`), save it."""
    for name, tensor in kv.items():
        worker.wait_for_layer(name)
        if compute is not None:
            compute(name, tensor)
        worker.save_layer(meta, name)
        if after_layer is not None:
            after_layer(name, tensor)


def test_a_save_copies_each_layer_once_the_forward_computed_it(make_pair):
    """Layer 0 is copied before wait_for_save (scribbling on it afterwards
    changes nothing saved); layer 1 is written by the forward only after
    layer 0 was saved and still arrives whole: no layer is read early."""
    sched, worker, kv = make_pair(seed=0, layer_wise=True)
    source = kv_caches(seed=3)
    tokens = prompt(3 * BLOCK)
    req = request("a", tokens)
    tables_of(sched)["a"] = [0, 1, 2]
    sched.after_alloc(req, [0, 1, 2], 0)
    meta = sched.build_meta(StepOutput({"a": len(tokens)}))
    assert [s.req_id for s in meta.saves] == ["a"]
    worker.start_loads(meta)

    def compute(name, tensor):
        tensor[[0, 1, 2]] = source[name][[0, 1, 2]]

    def scribble(name, tensor):
        worker.drain()  # this layer's copy has run: what the forward does next is not saved
        tensor[[0, 1, 2]] = -1.0

    forward(worker, meta, kv, compute, after_layer=scribble)
    worker.run_saves(meta)
    req.num_computed_tokens = len(tokens)
    assert sched.finished(req) is True
    worker.run_saves(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == ({"a"}, set())

    late = request("b", [*tokens, 5])
    assert sched.num_new_matched_tokens(late, 0) == (3 * BLOCK, True)
    sched.after_alloc(late, [8, 9, 10, 11], 3 * BLOCK)
    load_meta = sched.build_meta(StepOutput())
    worker.start_loads(load_meta)
    assert finished_eventually(worker) == (set(), {"b"})
    assert worker.load_errors() == set()
    for got, want in zip(blocks_of(kv, [8, 9, 10]), blocks_of(source, [0, 1, 2]), strict=True):
        assert np.array_equal(got, want)


def test_layer_wise_off_copies_at_wait_for_save(make_pair):
    """The same forward without layer_wise: the step's copy reads the
    blocks after the forward (here, the scribbled ones)."""
    sched, worker, kv = make_pair(seed=0, layer_wise=False)
    tokens = prompt(2 * BLOCK)
    req = request("a", tokens)
    tables_of(sched)["a"] = [0, 1]
    sched.after_alloc(req, [0, 1], 0)
    meta = sched.build_meta(StepOutput({"a": len(tokens)}))
    worker.start_loads(meta)

    def scribble(name, tensor):
        tensor[[0, 1]] = -2.0

    forward(worker, meta, kv, after_layer=scribble)
    worker.run_saves(meta)
    worker.drain()
    late = request("b", [*tokens, 5])
    assert sched.num_new_matched_tokens(late, 0) == (2 * BLOCK, True)
    sched.after_alloc(late, [8, 9, 10], 2 * BLOCK)
    worker.start_loads(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == (set(), {"b"})
    assert all((layer == -2.0).all() for layer in blocks_of(kv, [8, 9]))


def test_a_synchronous_load_lands_layer_by_layer(make_pair):
    """Each layer is in place when its wait_for_layer_load returns."""
    sched, worker, kv = make_pair(seed=4, load_async=False, layer_wise=True)
    tokens = prompt(3 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1, 2])
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    sched.after_alloc(req, [4, 5, 6, 7], 3 * BLOCK)
    meta = sched.build_meta(StepOutput())
    worker.start_loads(meta)
    want = blocks_of(kv, [0, 1, 2])
    for layer, (name, tensor) in enumerate(kv.items()):
        worker.wait_for_layer(name)
        assert np.array_equal(tensor[[4, 5, 6]].numpy(), want[layer]), layer
    with pytest.raises(ValueError, match="unknown KV layer"):
        worker.wait_for_layer("model.layers.9.self_attn.attn")
    worker.run_saves(meta)
    assert worker.finished() == (set(), set())  # synchronous: not reported
    assert worker.load_errors() == set()


def test_a_short_layered_load_is_reported_in_its_step(make_pair):
    """Blocks evicted between lookup and load: reported in the step's pass,
    before wait_for_save, once."""
    sched, worker, kv = make_pair(seed=7, load_async=False, layer_wise=True)
    tokens = prompt(3 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1, 2])
    assert sched.num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    sched.after_alloc(req, [8, 9, 10, 11], 3 * BLOCK)
    assert sched._client.delete(tokens[: 2 * BLOCK]) == 2  # blocks 1 and 2 go
    meta = sched.build_meta(StepOutput())
    worker.start_loads(meta)
    forward(worker, meta, kv)
    assert worker.load_errors() == {9, 10}
    worker.run_saves(meta)
    assert worker.load_errors() == set()
    assert np.array_equal(blocks_of(kv, [8])[0], blocks_of(kv, [0])[0])


def test_a_stalled_sidecar_fails_a_layered_load_for_recompute(sidecar, make_pair):
    """The sidecar stops answering before the load is planned: every layer's
    wait returns (within the client's timeout) and the blocks are reported
    for recompute, never taken as loaded."""
    sched, worker, kv = make_pair(seed=2, load_async=False, layer_wise=True)
    tokens = prompt(2 * BLOCK + 1)
    req = cached(sched, worker, tokens, [0, 1])
    assert sched.num_new_matched_tokens(req, 0) == (2 * BLOCK, False)
    sched.after_alloc(req, [4, 5, 6], 2 * BLOCK)
    meta = sched.build_meta(StepOutput({"b": 1}))
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        worker.start_loads(meta)
        forward(worker, meta, kv)
        worker.run_saves(meta)
        assert worker.load_errors() == {4, 5}
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)


def test_a_save_cut_off_by_a_killed_sidecar_is_a_miss_and_frees_its_blocks(sidecar, make_pair):
    """Planned and its layer 0 copied, then the sidecar dies: the save is
    a later miss, and vLLM is still told it may free the blocks."""
    sched, worker, kv = make_pair(seed=2, layer_wise=True)
    tables_of(sched)["c"] = [12, 13]
    saving = request("c", prompt(2 * BLOCK, start=500))
    sched.after_alloc(saving, [12, 13], 0)
    meta = sched.build_meta(StepOutput({"c": 2 * BLOCK}))
    assert [s.req_id for s in meta.saves] == ["c"]
    worker.start_loads(meta)
    names = list(kv)
    worker.save_layer(meta, names[0])
    worker.drain()  # planned, layer 0 copied
    sidecar.proc.send_signal(signal.SIGKILL)
    sidecar.proc.wait()
    for name in names[1:]:
        worker.save_layer(meta, name)
    worker.run_saves(meta)
    saving.num_computed_tokens = 2 * BLOCK
    assert sched.finished(saving) is True
    worker.run_saves(sched.build_meta(StepOutput()))
    assert finished_eventually(worker) == ({"c"}, set())


def test_layer_wise_is_validated_and_asks_vllm_for_piecewise_graphs():
    base = {"model_name": "m", "model_revision": "r", "engine_id": "e"}
    with pytest.raises(ValueError, match="layer_wise must be true or false"):
        ConnectorSettings.from_extra_config({"layer_wise": "yes"}, **base)
    assert ConnectorSettings.from_extra_config({"layer_wise": True}, **base).layer_wise is True


def test_the_connector_needs_piecewise_graphs_where_the_hooks_copy():
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    cls = glue.KVSidecarConnector
    assert cls.requires_piecewise_for_cudagraph({"layer_wise": True}) is True
    assert cls.requires_piecewise_for_cudagraph({"layer_wise": False}) is False
    assert cls.requires_piecewise_for_cudagraph({"load_async": False}) is True


def test_a_save_copies_only_the_computed_prefix_of_layers():
    """Layers reported out of order: the copies never pass a layer not computed yet."""
    saves = StepSaves(1, [])
    assert saves.computed_layer(1) is False and saves.prefix == 0
    assert saves.computed_layer(0) is True and saves.prefix == 2
    assert saves.computed_layer(3) is False and saves.prefix == 2
    assert saves.computed_layer(2) is True and saves.prefix == 4


def test_splits_stop_a_save_before_and_a_load_past():
    assert save_stop((1, 2, 3), 2) == 2 and load_stop((1, 2, 3), 2) == 2
    assert save_stop((4,), 2) == 0 and load_stop((4,), 2) == 4  # a cross-layer block: whole
    assert save_stop((4,), 4) == 4


def test_a_cross_layer_block_is_copied_whole_after_its_last_layer(sidecar):
    """BLNHC: a block's layers are one copy; layer-wise saves it once every
    layer is computed, loads it before the first layer is read."""
    geometry = dataclasses.replace(GEOMETRY, layout="BLNHC")
    assert geometry.layer_splits == (geometry.num_layers,)
    memory = torch.zeros(NUM_BLOCKS, geometry.num_layers, BLOCK, HEADS, 2 * HEAD_DIM)
    kv = {
        f"model.layers.{i}.self_attn.attn": memory[:, i].permute(0, 2, 1, 3)
        for i in range(geometry.num_layers)
    }
    source = torch.randn(memory.shape, generator=torch.Generator().manual_seed(9))
    s = settings(sidecar.endpoint, layer_wise=True, load_async=False)
    worker = WorkerSide(s, geometry)
    worker.register(kv)
    sched = scheduler_side(s, geometry=geometry)
    try:
        tokens = prompt(2 * BLOCK)
        req = request("a", tokens)
        tables_of(sched)["a"] = [0, 1]
        sched.after_alloc(req, [0, 1], 0)
        meta = sched.build_meta(StepOutput({"a": len(tokens)}))
        worker.start_loads(meta)

        def compute(name, tensor):
            memory[[0, 1], list(kv).index(name)] = source[[0, 1], list(kv).index(name)]

        forward(worker, meta, kv, compute)
        worker.run_saves(meta)
        worker.drain()
        late = request("b", [*tokens, 1])
        assert sched.num_new_matched_tokens(late, 0) == (2 * BLOCK, False)
        sched.after_alloc(late, [5, 6, 7], 2 * BLOCK)
        meta = sched.build_meta(StepOutput())
        worker.start_loads(meta)
        worker.wait_for_layer(next(iter(kv)))
        assert torch.equal(memory[[5, 6]], source[[0, 1]])  # every layer, before layer 0 runs
        worker.run_saves(meta)
        assert worker.load_errors() == set()
    finally:
        sched.close()
        worker.close()
