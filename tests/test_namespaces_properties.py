"""Property test of namespaces in one tier (CacheEngine) under every policy.

A hypothesis state machine stores sequences of four namespaces (0..3, keys
salted by namespace) the way a PUT does (lock the prefix, allocate under the
namespace's quota, insert ready or in flight), and runs lock, unlock,
set_ready, discard, matches, clock ticks, expire, clear_namespace and
set_quota between them. After every step:

- per-namespace counts equal a recount over the tree, and every node has
  its tree's namespace;
- slots are conserved: used == blocks in the index, no slot in two nodes;
- a namespace's blocks never exceed its quota (after a quota was lowered
  below what is locked, they never grow until back under it);
- a tree whose top is past its namespace's TTL is never matched;
and `clear_namespace(ns)` removes exactly the namespace's blocks that are
not locked, in flight or above such a block, and nothing else; `expire()`
leaves no expired tree that nothing holds.
"""

from __future__ import annotations

import numpy as np
from helpers import FakeClock, keys, machine_settings, walk
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sidecar.control.cache_engine import CacheEngine
from sidecar.control.node import RadixNode
from sidecar.control.policies import POLICY_NAMES

NAMESPACES = (0, 1, 2, 3)
SEQUENCE = st.tuples(
    st.sampled_from(NAMESPACES), st.integers(0, 2), st.integers(1, 8), st.integers(0, 2)
)
QUOTA = st.one_of(st.none(), st.integers(0, 10))


def sequence_keys(ns: int, family: int, length: int, branch: int):
    """Sequences of one family share a prefix; a branch diverges halfway."""
    ids = [family * 1000 + i for i in range(length)]
    if branch:
        half = length // 2
        ids[half:] = [family * 1000 + branch * 100 + i for i in range(half, length)]
    return keys(*ids, high=100 + ns)


def busy(node: RadixNode) -> bool:
    """Locked, in flight, or above such a node: clear_namespace keeps it."""
    return node.lock_count > 0 or any(not n.ready for n in walk(node))


class NamespaceMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(POLICY_NAMES),
        slots=st.integers(6, 30),
        threshold=st.sampled_from([1.0, 0.8]),
        ratio=st.sampled_from([0.0, 0.1]),
        quotas=st.tuples(QUOTA, QUOTA),
        ttl=st.sampled_from([None, 2.0, 5.0]),
    )
    def setup(self, policy, slots, threshold, ratio, quotas, ttl):
        self.clock = FakeClock()
        self.engine = CacheEngine("cpu", slots, policy, threshold, ratio, clock=self.clock)
        self.quotas: dict[int, int] = {}
        self.pending_quota: set[int] = set()
        for ns, quota in zip((1, 2), quotas, strict=True):
            if quota is not None:
                self.engine.set_quota(ns, quota)
                self.quotas[ns] = quota
        self.ttl = ttl
        if ttl is not None:
            self.engine.index.set_ttl(3, ttl)
        self.locks: list[RadixNode] = []
        self.pending: list[RadixNode] = []

    # ---- rules -------------------------------------------------------------------

    @rule(seq=SEQUENCE, ready=st.booleans())
    def put(self, seq, ready):
        ns = seq[0]
        k = sequence_keys(*seq)
        m = self.engine.match(k)
        if m.num_present > m.num_blocks or m.num_blocks == len(k):
            return
        before = self.engine.index.blocks_of(ns)
        if m.node is not None:
            self.engine.lock(m.node)
        slots = self.engine.allocate(len(k) - m.num_blocks, ns)
        if m.node is not None:
            self.engine.unlock(m.node)
        if ns in self.quotas:
            assert self.engine.index.blocks_of(ns) + slots.size <= max(self.quotas[ns], before)
        if slots.size:
            end = m.num_blocks + slots.size
            node = self.engine.insert(k[:end], slots, ready=ready, ns=ns).node
            if not ready:
                self.pending.append(node)

    @rule(seq=SEQUENCE)
    def match(self, seq):
        k = sequence_keys(*seq)
        m = self.engine.match(k, touch=True)
        assert self.engine.index.ready_blocks(k.tobytes()) == m.num_blocks
        if self._expired(self.engine.index.root.children.get(k[:1].tobytes())):
            assert m.num_blocks == 0

    @rule(seq=SEQUENCE)
    def lock(self, seq):
        m = self.engine.match(sequence_keys(*seq))
        if m.node is not None:
            self.engine.lock(m.node)
            self.locks.append(m.node)

    @rule(pick=st.integers(0, 100))
    def unlock(self, pick):
        if self.locks:
            self.engine.unlock(self.locks.pop(pick % len(self.locks)))

    @rule(pick=st.integers(0, 100), land=st.booleans())
    def finish_pending(self, pick, land):
        if self.pending:
            node = self.pending.pop(pick % len(self.pending))
            if land:
                self.engine.set_ready(node)
            else:
                self.engine.discard(node)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, dt):
        self.clock.set(self.clock.now + dt)

    @rule()
    def expire(self):
        used = self.engine.mempool.num_used
        dropped = self.engine.expire()
        assert self.engine.mempool.num_used == used - dropped
        for top in self.engine.index.root.children.values():
            assert not self._expired(top) or busy(top)

    @rule(ns=st.sampled_from(NAMESPACES))
    def clear_namespace(self, ns):
        index = self.engine.index
        before = self._slots_by_ns()
        kept_nodes = [
            n for n in walk(index.root) if n.parent is not None and n.ns == ns and busy(n)
        ]
        kept = {s for n in kept_nodes for s in n.slots.tolist()}
        removed, num_kept = self.engine.clear_namespace(ns)
        after = self._slots_by_ns()
        assert after.get(ns, set()) == kept and num_kept == len(kept)
        assert removed == len(before.get(ns, set())) - len(kept)
        assert {n: s for n, s in after.items() if n != ns and s} == {
            n: s for n, s in before.items() if n != ns and s
        }

    @rule(ns=st.sampled_from((1, 2)), quota=st.integers(0, 10))
    def set_quota(self, ns, quota):
        index = self.engine.index
        pinned = sum(
            len(n) for n in walk(index.root) if n.parent is not None and n.ns == ns and busy(n)
        )
        self.engine.set_quota(ns, quota)
        self.quotas[ns] = quota
        assert index.blocks_of(ns) <= max(quota, pinned)
        if index.blocks_of(ns) > quota:
            self.pending_quota.add(ns)

    # ---- invariants ------------------------------------------------------------------

    def _expired(self, top: RadixNode | None) -> bool:
        return (
            top is not None
            and self.ttl is not None
            and top.ns == 3
            and top.born < self.clock.now - self.ttl
        )

    def _slots_by_ns(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for node in walk(self.engine.index.root):
            if node.parent is not None:
                out.setdefault(node.ns, set()).update(node.slots.tolist())
        return out

    @invariant()
    def counts_equal_a_recount(self):
        index = self.engine.index
        counts: dict[int, int] = {}
        for top in index.root.children.values():
            for node in walk(top):
                assert node.ns == top.ns
                counts[node.ns] = counts.get(node.ns, 0) + len(node)
        assert index.namespace_blocks() == {ns: n for ns, n in counts.items() if n}
        assert all(index.blocks_of(ns) == counts.get(ns, 0) for ns in NAMESPACES)

    @invariant()
    def slots_are_conserved(self):
        index, pool = self.engine.index, self.engine.mempool
        slots = [s for n in walk(index.root) for s in n.slots.tolist()]
        assert len(slots) == len(set(slots)) == index.num_blocks == pool.num_used
        assert not any(pool.is_free(s) for s in slots)

    @invariant()
    def quotas_hold(self):
        for ns, quota in self.quotas.items():
            blocks = self.engine.index.blocks_of(ns)
            if ns in self.pending_quota:
                if blocks <= quota:
                    self.pending_quota.discard(ns)
                continue
            assert blocks <= quota, (ns, blocks, quota)

    @invariant()
    def expired_trees_are_never_matched(self):
        index = self.engine.index
        for top in index.root.children.values():
            if self._expired(top):
                k = np.frombuffer(top.key_bytes[:16], dtype=top.keys.dtype)
                assert index.match(k).num_blocks == 0
                assert index.ready_blocks(top.key_bytes) == 0


NamespaceMachine.TestCase.settings = machine_settings(200)
test_namespace_state_machine = NamespaceMachine.TestCase
