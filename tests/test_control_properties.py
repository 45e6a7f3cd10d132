"""Property test of the whole control plane against a model of the bytes.

A hypothesis state machine drives a GlobalCacheEngine (CPU + SSD + remote,
tiny capacities, every policy and write policy) with random PUTs, GETs, op
completions, failures and cancels. The test plays the data plane itself:
each tier slot holds the id of the block whose bytes it carries, ops move
those ids when they complete, and a failed op scribbles garbage over its
destination. After every step it checks:

- every ready block in every tier holds its own bytes (a half-written or
  reused slot is never visible), and every H2D delivered the right block;
- slots are conserved: used == blocks in the index + slots kept for
  write-back, no slot in two nodes, no node slot in the free pool;
- lock counts equal the locks running plans hold, along the path;
- an unready node has no children;
- match() equals the longest ready prefix computed from a flat set;
and at the end, with every plan finished, nothing is locked or leaked.
"""

from __future__ import annotations

import os

import numpy as np
from helpers import machine_settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from contract.ids import keys_from_ints
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.graph import OpKind
from sidecar.control.node import RadixNode
from sidecar.control.planner import GlobalCacheEngine, WritePolicy
from sidecar.control.policies import POLICY_NAMES

GARBAGE = -7
TIERS = ("cpu", "ssd", "remote")


class Interner:
    """Chained block ids: equal id <=> equal prefix, like chained hashes."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, ...], int] = {}

    def chain(self, tokens: tuple[int, ...]) -> np.ndarray:
        return np.array(
            [self.ids.setdefault(tokens[: i + 1], len(self.ids) + 1) for i in range(len(tokens))],
            dtype=np.int64,
        )


def walk(node: RadixNode):
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        stack.extend(cur.children.values())


def node_ids(node: RadixNode) -> np.ndarray:
    return np.frombuffer(node.key_bytes, dtype=np.uint64)[::2].astype(np.int64)


class ControlPlaneMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(POLICY_NAMES),
        write_policy=st.sampled_from([w.value for w in WritePolicy]),
        cpu_slots=st.integers(4, 24),
        ssd_slots=st.integers(0, 32),
        remote_slots=st.integers(0, 32),
        threshold=st.sampled_from([1.0, 0.8]),
        ratio=st.sampled_from([0.0, 0.1]),
    )
    def setup(self, policy, write_policy, cpu_slots, ssd_slots, remote_slots, threshold, ratio):
        self.now = 0.0

        def make(name: str, n: int) -> CacheEngine:
            return CacheEngine(name, n, policy, threshold, ratio, 1.0, lambda: self.now)

        self.tiers = {"cpu": make("cpu", cpu_slots)}
        if ssd_slots:
            self.tiers["ssd"] = make("ssd", ssd_slots)
        if remote_slots:
            self.tiers["remote"] = make("remote", remote_slots)
        self.engine = GlobalCacheEngine(
            self.tiers["cpu"],
            self.tiers.get("ssd"),
            self.tiers.get("remote"),
            write_policy=write_policy,
            write_through_min_hits=2,
        )
        self.content = {name: np.full(t.capacity, GARBAGE) for name, t in self.tiers.items()}
        self.interner = Interner()
        self.plans: dict[int, dict] = {}  # plan_id -> {"plan", "ids", "done"}

    # ---- requests -------------------------------------------------------------

    @rule(family=st.integers(0, 3), length=st.integers(1, 12), branch=st.integers(0, 3))
    def put(self, family, length, branch):
        ids = self._sequence(family, length, branch)
        plan = self.engine.put(keys_from_ints(ids), np.arange(ids.size))
        self._track(plan, ids)

    @rule(
        family=st.integers(0, 3),
        length=st.integers(1, 12),
        branch=st.integers(0, 3),
        skip=st.integers(0, 12),
        part=st.integers(0, 4),
    )
    def get(self, family, length, branch, skip, part):
        ids = self._sequence(family, length, branch)
        skip = min(skip, ids.size)
        keys = keys_from_ints(ids)
        expected = self._ready_prefix("cpu", ids)
        # part > 0: a load in parts of `part` blocks (staged blocks made ready part by part).
        ready_at = range(skip + part, ids.size, part) if part else ()
        plan = self.engine.get(keys, np.arange(ids.size), skip=skip, ready_at=ready_at)
        assert plan.hit_blocks.cpu == max(0, expected - skip)
        self._track(plan, ids)

    @rule(
        family=st.integers(0, 3),
        length=st.integers(1, 12),
        branch=st.integers(0, 3),
        part=st.integers(1, 4),
    )
    def stage_in_parts(self, family, length, branch, part):
        """The sidecar's staging pass for the first part of a load in parts:
        every lower-tier block past the CPU prefix, made ready part by part."""
        ids = self._sequence(family, length, branch)
        keys = keys_from_ints(ids)
        ready_at = range(part, ids.size, part)
        plan = self.engine.get(keys, np.arange(ids.size), ids.size, hit=False, ready_at=ready_at)
        self._track(plan, ids)

    @precondition(lambda self: "ssd" in self.tiers)
    @rule(family=st.integers(0, 3), length=st.integers(1, 12), branch=st.integers(0, 3))
    def found_on_ssd(self, family, length, branch):
        """Blocks a restart recovered from SSD: ready there, in no other tier
        (so GETs stage them, in parts or whole)."""
        ids = self._sequence(family, length, branch)
        keys, ssd = keys_from_ints(ids), self.tiers["ssd"]
        m = ssd.match(keys)
        if m.num_present > m.num_blocks:
            return  # blocks past it in flight there
        ssd.lock(m.node) if m.node is not None else None
        try:
            slots = ssd.allocate(ids.size - m.num_blocks)
        finally:
            if m.node is not None:
                ssd.unlock(m.node)
        self._track_background()
        end = m.num_blocks + slots.size
        if slots.size:
            ssd.insert(keys[:end], slots, ready=True)
            self.content["ssd"][slots] = ids[m.num_blocks : end]

    @rule(blocks=st.integers(1, 8))
    def evict_cpu(self, blocks):
        """Pressure from elsewhere: CPU blocks leave (under write_back, written
        down first), so later GETs stage them from below."""
        self.tiers["cpu"].evict(blocks)
        self._track_background()

    def _sequence(self, family: int, length: int, branch: int) -> np.ndarray:
        # Families share leading tokens; branches diverge after half the length.
        tokens = tuple(
            family * 100 + i if i < length // 2 else branch * 1000 + i for i in range(length)
        )
        self.now += 1.0
        return self.interner.chain(tokens)

    def _track(self, plan, ids: np.ndarray) -> None:
        if plan.graph.ops:
            self.plans[plan.plan_id] = {"plan": plan, "ids": ids, "done": set()}
        self._track_background()

    def _track_background(self) -> None:
        for bg in self.engine.drain_background():
            if bg.graph.ops:
                self.plans[bg.plan_id] = {"plan": bg, "ids": None, "done": set()}

    # ---- op completion / failure ---------------------------------------------

    def _ready_ops(self):
        for pid, entry in sorted(self.plans.items()):
            for op in entry["plan"].graph.ops:
                if op.op_id not in entry["done"] and all(d in entry["done"] for d in op.deps):
                    yield pid, op

    @precondition(lambda self: self.plans)
    @rule(pick=st.integers(0, 10_000))
    def complete(self, pick):
        ready = list(self._ready_ops())
        pid, op = ready[pick % len(ready)]
        entry = self.plans[pid]
        self._move_bytes(op, entry["ids"])
        entry["done"].add(op.op_id)
        finished = self.engine.complete(pid, op.op_id)
        assert finished == (len(entry["done"]) == len(entry["plan"].graph.ops))
        if finished:
            del self.plans[pid]

    @precondition(lambda self: self.plans)
    @rule(pick=st.integers(0, 10_000), cancel=st.booleans())
    def fail(self, pick, cancel):
        ready = list(self._ready_ops())
        pid, op = ready[pick % len(ready)]
        if cancel:
            self.engine.cancel(pid)
        else:
            tier = _dst_tier(op.kind)
            if tier is not None:  # a half-written destination
                self.content[tier][op.dst] = GARBAGE
            self.engine.fail(pid, op.op_id)
        del self.plans[pid]

    def _move_bytes(self, op, ids: np.ndarray | None) -> None:
        src_tier, dst_tier = _src_tier(op.kind), _dst_tier(op.kind)
        # For D2H, the engine's GPU block p holds block p of the request.
        data = ids[op.src] if op.kind is OpKind.D2H else self.content[src_tier][op.src]
        if op.kind is OpKind.H2D:
            assert np.array_equal(data, ids[op.dst]), "H2D delivered the wrong bytes"
        else:
            self.content[dst_tier][op.dst] = data

    @rule(seconds=st.floats(0.0, 5.0))
    def tick(self, seconds):
        self.now += seconds

    # ---- invariants ---------------------------------------------------------------

    def _ready_prefix(self, tier: str, ids: np.ndarray) -> int:
        ready = {
            int(i)
            for node in walk(self.tiers[tier].index.root)
            if node.ready and node.parent is not None
            for i in node_ids(node)
        }
        n = 0
        while n < ids.size and int(ids[n]) in ready:
            n += 1
        return n

    @invariant()
    def ready_blocks_hold_their_bytes(self):
        if not hasattr(self, "tiers"):
            return
        for name, tier in self.tiers.items():
            for node in walk(tier.index.root):
                if node.parent is None:
                    continue
                if node.ready:
                    assert np.array_equal(self.content[name][node.slots], node_ids(node)), name
                else:
                    assert not node.children, "an unready node has children"

    @invariant()
    def slots_conserved(self):
        if not hasattr(self, "tiers"):
            return
        held = {name: 0 for name in self.tiers}
        for run in self.engine._runs.values():
            for engine, slots in run.held:
                held[engine.name] += slots.size
        for name, tier in self.tiers.items():
            slots = [s for node in walk(tier.index.root) for s in node.slots.tolist()]
            assert len(slots) == len(set(slots)) == tier.index.num_blocks, name
            assert not any(tier.mempool.is_free(s) for s in slots), name
            assert tier.mempool.num_used == len(slots) + held[name], name

    @invariant()
    def locks_match_running_plans(self):
        if not hasattr(self, "tiers"):
            return
        expected: dict[int, int] = {}
        for run in self.engine._runs.values():
            for _, node in run.locks:
                cur = node
                while cur is not None:
                    expected[id(cur)] = expected.get(id(cur), 0) + 1
                    cur = cur.parent
        for tier in self.tiers.values():
            for node in walk(tier.index.root):
                if node.parent is not None:
                    assert node.lock_count == expected.get(id(node), 0)

    @invariant()
    def match_is_longest_ready_prefix(self):
        if not hasattr(self, "tiers"):
            return
        for tokens, _ in list(self.interner.ids.items())[-5:]:
            ids = self.interner.chain(tokens)
            keys = keys_from_ints(ids)
            for name, tier in self.tiers.items():
                assert tier.match(keys).num_blocks == self._ready_prefix(name, ids)

    def teardown(self):
        if not hasattr(self, "tiers"):
            return
        while self.plans:
            self.complete(0)
        assert self.engine.num_active_plans == 0
        for tier in self.tiers.values():
            assert tier.mempool.num_used == tier.index.num_blocks
            assert all(n.lock_count == 0 for n in walk(tier.index.root))
            assert all(n.ready for n in walk(tier.index.root))


def _src_tier(kind: OpKind) -> str | None:
    return {
        OpKind.H2D: "cpu",
        OpKind.H2DISK: "cpu",
        OpKind.H2REMOTE: "cpu",
        OpKind.DISK2H: "ssd",
        OpKind.REMOTE2H: "remote",
    }.get(kind)


def _dst_tier(kind: OpKind) -> str | None:
    return {
        OpKind.D2H: "cpu",
        OpKind.DISK2H: "cpu",
        OpKind.REMOTE2H: "cpu",
        OpKind.H2DISK: "ssd",
        OpKind.H2REMOTE: "remote",
    }.get(kind)


ControlPlaneMachine.TestCase.settings = machine_settings(
    int(os.environ.get("PROPERTY_EXAMPLES", "150"))
)
TestControlPlane = ControlPlaneMachine.TestCase
