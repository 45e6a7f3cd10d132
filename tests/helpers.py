"""Shared builders for the control-plane tests: a fake clock, keys, engines,
and whole-state checks. Add functions here; keep the existing ones stable."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings

from contract.ids import BlockKeys, GpuBlockIds, as_gpu_blocks, keys_from_ints
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.graph import OpKind
from sidecar.control.index import RadixIndex
from sidecar.control.node import RadixNode
from sidecar.control.plan import Plan
from sidecar.control.planner import GlobalCacheEngine
from sidecar.control.policies import make_policy


class FakeClock:
    """A clock whose time only moves when a test sets it; pass it as `clock=`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def set(self, now: float) -> None:
        self.now = now


def keys(*ids: int, high: int = 0) -> BlockKeys:
    """Keys from integer ids (one key per id); `high` separates namespaces."""
    return keys_from_ints(list(ids), high)


def chain(n: int, start: int = 1, high: int = 0) -> BlockKeys:
    """A run of n keys with ids start, start+1, ...: one request's prefix."""
    return keys_from_ints(np.arange(start, start + n), high)


def cat(*runs: BlockKeys) -> BlockKeys:
    return BlockKeys(np.concatenate(runs))


def key_ids(key_bytes: bytes) -> list[int]:
    """The integer ids of keys built by `keys`/`chain`, from raw key bytes."""
    return [int(x) for x in np.frombuffer(key_bytes, dtype=np.uint64)[::2]]


def gpu(n: int, base: int = 100) -> GpuBlockIds:
    return as_gpu_blocks(np.arange(base, base + n))


def make_index(policy: str = "lru", clock: FakeClock | None = None, **kwargs) -> RadixIndex:
    reward = kwargs.pop("hit_reward_seconds", 0.0)
    return RadixIndex(make_policy(policy, reward), clock or FakeClock(), **kwargs)


def make_engine(name: str, num_slots: int, policy: str = "lru", **kwargs) -> CacheEngine:
    """A tier that evicts only when full (threshold 1.0, ratio 0) unless told otherwise."""
    kwargs.setdefault("evict_start_threshold", 1.0)
    kwargs.setdefault("evict_ratio", 0.0)
    kwargs.setdefault("clock", FakeClock())
    return CacheEngine(name, num_slots, policy, **kwargs)


def put_ready(engine: CacheEngine, prefix: BlockKeys) -> np.ndarray:
    """Store the blocks of `prefix` the engine lacks as ready; returns their slots."""
    have = engine.match(prefix).num_blocks
    slots = engine.allocate(len(prefix) - have)
    assert slots.size == len(prefix) - have, "engine too small for the test"
    engine.insert(prefix, slots, ready=True)
    return slots


def walk(node: RadixNode) -> Iterator[RadixNode]:
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        stack.extend(cur.children.values())


def op_rows(plan: Plan) -> list[tuple[OpKind, list[int], list[int], tuple[int, ...]]]:
    """A plan's ops as (kind, src, dst, deps) rows, for exact comparison."""
    return [(op.kind, op.src.tolist(), op.dst.tolist(), op.deps) for op in plan.graph.ops]


def finish(g: GlobalCacheEngine, plan: Plan) -> None:
    """Complete every op of a plan in order."""
    for op in plan.graph.ops:
        g.complete(plan.plan_id, op.op_id)


def tiers(g: GlobalCacheEngine) -> list[CacheEngine]:
    return [g.cpu, *g.lower.values()]


def assert_engine_clean(engine: CacheEngine, *, held: int = 0) -> None:
    """No leak, no lock, nothing in flight: used slots are exactly the index's
    slots (plus `held` kept for write-back), and every node is ready."""
    index, pool = engine.index, engine.mempool
    slots = [s for node in walk(index.root) for s in node.slots.tolist()]
    assert len(slots) == len(set(slots)) == index.num_blocks, engine.name
    assert not any(pool.is_free(s) for s in slots), engine.name
    assert pool.num_used == index.num_blocks + held, engine.name
    assert pool.num_free + pool.num_used == pool.num_slots, engine.name
    assert sum(not pool.is_free(s) for s in range(pool.num_slots)) == pool.num_used
    for node in walk(index.root):
        assert node.lock_count == 0, (engine.name, node)
        assert node.ready, (engine.name, node)


def assert_clean(g: GlobalCacheEngine) -> None:
    assert g.num_active_plans == 0
    for engine in tiers(g):
        assert_engine_clean(engine)


DEADLINE = 120.0
"""How long a router test waits for what must happen (as sidecar_proc.DEADLINE):
long, for a loaded machine; a test that passes never waits it out."""


def wait_until(
    cond: Callable[[], bool], subs: Any, timeout: float = DEADLINE, expire: bool = False
) -> None:
    """Feed a router's `Subscriptions` its waiting messages until `cond()`
    holds; with `expire`, also expire silent workers, as router serve does."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, dict(subs.counts)
        for sock in subs.sockets:
            if sock.poll(20):
                subs.drain(sock)
        if expire:
            subs.expire()


def wait_subscribed(xpub: Any, timeout: float = DEADLINE) -> None:
    """Wait for a subscription to reach `xpub` (a zmq.XPUB socket): from then
    on what it sends reaches that subscriber, where a PUB drops whatever it
    sends before a SUB has connected and subscribed. Call once per SUB."""
    assert xpub.poll(int(timeout * 1000)), "no subscriber connected"
    assert xpub.recv()[:1] == b"\x01", "not a subscription"


def machine_settings(max_examples: int, steps: int = 40) -> settings:
    """Settings of a hypothesis state machine: no deadline (a loaded CI
    machine is slow), slow examples allowed."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
