"""The connector with tensor parallelism, driven by vLLM's own classes: its
scheduler in this process, each worker rank a process of its own with
vLLM's TP group (tests/vllm_ranks.py), all on one real sidecar. Chunked
prefill, concurrent requests sharing a prefix, preemption and aborts; every
prompt's KV (loaded or computed) checked byte for byte on every rank.

Skipped where vLLM is not importable (CI installs none): run with
`python -m sideenv run vllm -- python -m pytest tests/test_vllm_connector_tp.py`.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler", reason="vLLM is not installed here (see docs/engines.md)"
)

from sidecar_proc import Sidecar, stats_of
from vllm_ranks import BLOCK, TPEngine


@pytest.fixture(autouse=True)
def fixed_hash_seed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")


@pytest.fixture
def sidecar():
    s = Sidecar(capacity="8MiB").start()
    yield s
    s.cleanup()


def cached(engine: TPEngine, tokens: list[int]) -> int:
    """Tokens of `tokens` the sidecar holds, asked as the scheduler side does."""
    return engine.scheduler.connector._scheduler._client.lookup(tokens)


def prompt(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 900 + 1 for i in range(n)]


@pytest.mark.parametrize(
    ("tp", "extra"),
    [(2, {}), (4, {}), (2, {"layer_wise": True, "load_async": False})],
    ids=["tp2", "tp4", "tp2-layer-wise-sync-load"],
)
def test_a_running_request_is_hit_by_one_sharing_its_prefix(tmp_path, sidecar, tp, extra):
    """a's prompt prefills in 64-token chunks; each full block is saved in
    its chunk's step, so b (same prefix) loads them while a still runs."""
    engine = TPEngine(tmp_path, sidecar.endpoint, tp=tp, block_keys="tokens", **extra)
    try:
        tokens = prompt(10 * BLOCK + 3)
        engine.add("a", tokens, max_tokens=150)
        engine.run(lambda: len(engine.computed.get("a", ())) >= 6 * BLOCK)
        engine.run(lambda: cached(engine, tokens[: 4 * BLOCK]) == 4 * BLOCK)  # saves landed
        engine.add("b", [*tokens[: 4 * BLOCK], 5, 6, 7])
        engine.run(lambda: engine.finished("b"))
        assert "a" in engine.scheduler.requests, "a should still run"
        assert min(engine.computed["b"]) >= 4 * BLOCK  # b's 4 blocks came from the sidecar
        engine.run(lambda: engine.finished("a"))
        assert {"a", "b"} <= engine.checked
        assert all(not kv.invalid_block_ids for _, kv in engine.outputs)
        # Every full block a computed (prompt and decode) was stored once: none twice.
        computed = len(tokens) + 150 - 1  # the last sampled token is never computed
        assert stats_of(sidecar)["transfers"]["saved_blocks"] == computed // BLOCK
    finally:
        engine.close()


def test_preempted_and_aborted_requests_keep_what_was_saved(tmp_path, sidecar):
    """Four requests sharing a prefix on too few engine blocks: vLLM preempts
    some (their saved blocks stay valid and are loaded when they resume);
    one is aborted mid-prefill (what it saved stays, nothing more shows)."""
    engine = TPEngine(tmp_path, sidecar.endpoint, tp=2, num_blocks=40, block_keys="tokens")
    try:
        shared = prompt(6 * BLOCK, start=300)
        names = ["p0", "p1", "p2", "p3"]
        for i, name in enumerate(names):
            engine.add(name, [*shared, *prompt(3 * BLOCK + i, start=600 + 50 * i)], max_tokens=100)
        engine.run(lambda: engine.finished(*names))
        assert engine.resumed_at, "no request was preempted: the test needs fewer blocks"
        # A resumed request loads what it saved before (vLLM's own prefix cache is off).
        assert any(start > 0 for starts in engine.resumed_at.values() for start in starts)
        assert set(names) <= engine.checked  # every KV, resumed ones' too, exact
        assert all(not kv.invalid_block_ids for _, kv in engine.outputs)

        victim = prompt(8 * BLOCK, start=800)
        engine.add("abort", victim, max_tokens=10)
        engine.run(lambda: len(engine.computed.get("abort", ())) >= 4 * BLOCK)
        engine.abort("abort")
        done = len(engine.computed["abort"]) // BLOCK  # its steps ran: these are offered
        engine.run(lambda: cached(engine, victim) == done * BLOCK)  # they land, none past
        engine.add("again", [*victim, 1])
        engine.run(lambda: engine.finished("again"))
        assert min(engine.computed["again"]) == done * BLOCK
        assert "again" in engine.checked
        assert cached(engine, victim) == len(victim)  # "again" saved the rest
    finally:
        engine.close()


def test_mla_stores_one_copy_and_loads_it_into_every_rank(tmp_path, sidecar):
    engine = TPEngine(tmp_path, sidecar.endpoint, tp=2, mla=True, block_keys="tokens")
    try:
        tokens = prompt(5 * BLOCK + 1, start=100)
        engine.add("a", tokens)
        engine.run(lambda: engine.finished("a"))
        saved = stats_of(sidecar)["transfers"]["saved_blocks"]
        assert saved == 5
        engine.add("b", tokens)
        engine.run(lambda: engine.finished("b"))
        assert min(engine.computed["b"]) == 5 * BLOCK  # every rank loaded the one copy
        assert "b" in engine.checked
    finally:
        engine.close()


def test_a_rank_that_loses_the_sidecar_reports_for_recompute_on_all(tmp_path, sidecar):
    engine = TPEngine(tmp_path, sidecar.endpoint, tp=2, block_keys="tokens")
    try:
        tokens = prompt(4 * BLOCK + 1, start=200)
        engine.add("a", tokens)
        engine.run(lambda: engine.finished("a"))
        engine.add("b", tokens)

        def kill_before_the_load(out) -> None:
            if out.kv_connector_metadata.loads:
                sidecar.kill()

        engine.run(lambda: engine.finished("b"), before_forward=kill_before_the_load)
        assert any(kv.invalid_block_ids for _, kv in engine.outputs)
        assert min(engine.computed["b"]) == 0  # recomputed on every rank
        assert "b" in engine.checked
    finally:
        engine.close()
