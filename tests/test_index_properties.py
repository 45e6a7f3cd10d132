"""Property test of RadixIndex alone against a flat reference model.

A hypothesis state machine runs random insert (ready or in flight), match
(with and without touch), lock, unlock, set_ready, discard, evict and remove on one
index, under every policy. The model is a dict from each block's whole prefix
(a tuple of ids) to its slot and readiness, plus the list of held locks.
After every step:

- the index holds exactly the model's blocks, slots and readiness;
- match() and ready_blocks() of every sequence give the model's longest ready prefix;
- each node's lock count is the number of held locks at or below it;
- the policy's candidates are exactly the ready, unlocked leaves;
- under the S3-FIFO policies and arc, each queue's block count is the blocks
  of the nodes in it, and the small (recent) queue's share stays within
  SHARE_BOUNDS; under arc, each queue's candidate count is its evictable leaves;
and every evict(n) removes exactly min(n, evictable) blocks, each of them
ready, unlocked and without an in-flight block below it.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FakeClock, key_ids, keys, machine_settings, make_index, walk
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sidecar.control.arc import ArcPolicy
from sidecar.control.index import IndexConflict, RadixIndex
from sidecar.control.node import RadixNode
from sidecar.control.policies import POLICY_NAMES
from sidecar.control.s3fifo import S3FifoPolicy
from sidecar.control.two_queues import SHARE_BOUNDS

Prefix = tuple[int, ...]

SEQUENCE = st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(0, 2))


def sequence(family: int, length: int, branch: int) -> Prefix:
    """Sequences of one family share a prefix; a branch diverges halfway."""
    ids = [family * 1000 + i for i in range(length)]
    if branch:
        half = length // 2
        ids[half:] = [family * 1000 + branch * 100 + i for i in range(half, length)]
    return tuple(ids)


def node_path(index: RadixIndex, node: RadixNode) -> Prefix:
    path_keys, _ = index.path(node)
    return tuple(key_ids(path_keys.tobytes()))


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[Prefix, tuple[int, bool]] = {}  # prefix -> (slot, ready)
        self.locks: list[tuple[RadixNode, Prefix]] = []
        self.pending: list[RadixNode] = []
        self.next_slot = 0

    @initialize(policy=st.sampled_from(POLICY_NAMES))
    def setup(self, policy: str) -> None:
        self.clock = FakeClock()
        self.index = make_index(policy, self.clock)

    # ---- model ---------------------------------------------------------------

    def present(self, seq: Prefix) -> int:
        n = 0
        while n < len(seq) and seq[: n + 1] in self.blocks:
            n += 1
        return n

    def ready_prefix(self, seq: Prefix) -> int:
        n = 0
        while n < len(seq) and self.blocks.get(seq[: n + 1], (0, False))[1]:
            n += 1
        return n

    def evictable(self) -> set[Prefix]:
        """Ready blocks with no lock and no in-flight block at or below them."""
        pinned: set[Prefix] = set()
        for _, p in self.locks:
            pinned.update(p[:i] for i in range(1, len(p) + 1))
        for p, (_, ready) in self.blocks.items():
            if not ready:
                pinned.update(p[:i] for i in range(1, len(p) + 1))
        return {p for p, (_, ready) in self.blocks.items() if ready and p not in pinned}

    # ---- rules -----------------------------------------------------------------

    @rule(seq=SEQUENCE, ready=st.booleans(), overlap=st.booleans())
    def insert(self, seq, ready, overlap):
        seq = sequence(*seq)
        have = self.present(seq)
        num_new = len(seq) - have + (1 if overlap and have else 0)
        slots = np.arange(self.next_slot, self.next_slot + num_new)
        ends_unready = have > 0 and not self.blocks[seq[:have]][1]
        if (overlap and have) or (ends_unready and num_new):
            with pytest.raises(IndexConflict):
                self.index.insert(keys(*seq), slots, ready=ready)
            return
        result = self.index.insert(keys(*seq), slots, ready=ready)
        assert result.num_new == num_new
        self.next_slot += num_new
        for i, slot in enumerate(slots.tolist()):
            self.blocks[seq[: have + i + 1]] = (slot, ready)
        if num_new and not ready:
            self.pending.append(result.node)

    @rule(seq=SEQUENCE, touch=st.booleans())
    def match(self, seq, touch):
        seq = sequence(*seq)
        self.clock.set(self.clock.now + 1.0)
        n = self.ready_prefix(seq)
        assert self.index.ready_blocks(keys(*seq).tobytes()) == n  # what lookups count
        m = self.index.match(keys(*seq), touch=touch)
        assert m.num_blocks == n
        assert m.slots.tolist() == [self.blocks[seq[: i + 1]][0] for i in range(n)]

    @rule(seq=SEQUENCE)
    def lock(self, seq):
        m = self.index.match(keys(*sequence(*seq)))
        if m.node is not None:
            self.index.lock(m.node)
            self.locks.append((m.node, node_path(self.index, m.node)))

    @rule(pick=st.integers(0, 100))
    def unlock(self, pick):
        if self.locks:
            node, _ = self.locks.pop(pick % len(self.locks))
            self.index.unlock(node)

    @rule(pick=st.integers(0, 100))
    def set_ready(self, pick):
        if self.pending:
            node = self.pending.pop(pick % len(self.pending))
            path = node_path(self.index, node)
            self.index.set_ready(node)
            for i in range(len(path) - len(node), len(path)):
                slot, _ = self.blocks[path[: i + 1]]
                self.blocks[path[: i + 1]] = (slot, True)

    @rule(pick=st.integers(0, 100))
    def discard(self, pick):
        if self.pending:
            node = self.pending.pop(pick % len(self.pending))
            path = node_path(self.index, node)
            slots = self.index.discard(node)
            gone = [path[: i + 1] for i in range(len(path) - len(node), len(path))]
            assert slots.tolist() == [self.blocks[p][0] for p in gone]
            for p in gone:
                del self.blocks[p]

    @rule(num_blocks=st.integers(0, 12))
    def evict(self, num_blocks):
        candidates = self.evictable()
        before = set(self.blocks)
        result = self.index.evict(num_blocks)
        after = {
            p for n in walk(self.index.root) if n.parent is not None for p in self._blocks_of(n)
        }
        removed = before - after
        assert result.num_blocks == len(removed) == min(num_blocks, len(candidates))
        assert removed <= candidates, "evicted a locked, unready or pinned block"
        assert sorted(result.slots.tolist()) == sorted(self.blocks[p][0] for p in removed)
        for p in removed:
            del self.blocks[p]

    @rule(seq=SEQUENCE, cut=st.integers(1, 9), pick=st.integers(0, 10_000))
    def remove(self, seq, cut, pick):
        """Mostly a present block (any state), sometimes an arbitrary prefix."""
        present = sorted(self.blocks)
        target = present[pick % len(present)] if present and pick % 4 else sequence(*seq)[:cut]
        below = {p for p in self.blocks if p[: len(target)] == target}
        busy = any(p[: len(target)] == target for _, p in self.locks) or not all(
            self.blocks[p][1] for p in below
        )
        if self.ready_prefix(target) < len(target) or busy:
            before = dict(self.blocks)
            with pytest.raises(IndexConflict):
                self.index.remove(keys(*target))
            assert self.blocks == before
            return
        slots = self.index.remove(keys(*target))
        assert sorted(slots.tolist()) == sorted(self.blocks[p][0] for p in below)
        for p in below:
            del self.blocks[p]

    @rule()
    def bad_unlock_changes_nothing(self):
        unlocked = [n for n in walk(self.index.root) if n.parent is not None and not n.lock_count]
        if unlocked:
            with pytest.raises(IndexConflict):
                self.index.unlock(unlocked[0])

    # ---- invariants --------------------------------------------------------------

    def _blocks_of(self, node: RadixNode) -> list[Prefix]:
        path = node_path(self.index, node)
        return [path[: i + 1] for i in range(len(path) - len(node), len(path))]

    @invariant()
    def index_holds_the_model(self):
        seen: dict[Prefix, tuple[int, bool]] = {}
        for node in walk(self.index.root):
            if node.parent is None:
                continue
            for p, slot in zip(self._blocks_of(node), node.slots.tolist(), strict=True):
                assert p not in seen
                seen[p] = (slot, node.ready)
            if not node.ready:
                assert not node.children, "an in-flight node has children"
        assert seen == self.blocks
        assert self.index.num_blocks == len(self.blocks)

    @invariant()
    def lock_counts_count_held_locks(self):
        for node in walk(self.index.root):
            if node.parent is None:
                continue
            path = node_path(self.index, node)
            held = sum(1 for _, p in self.locks if p[: len(path)] == path)
            assert node.lock_count == held

    @invariant()
    def candidates_are_the_evictable_leaves(self):
        leaves = [n for n in walk(self.index.root) if n.evictable]
        assert self.index.policy.num_candidates == len(leaves)
        assert all(n.heap_token is not None for n in leaves)

    @invariant()
    def queues_count_their_blocks(self):
        policy = self.index.policy
        if not isinstance(policy, S3FifoPolicy | ArcPolicy):
            return
        counts, candidates = [0, 0], [0, 0]
        for node in walk(self.index.root):
            if node.parent is not None:
                counts[node.policy_state.queue] += len(node)
                candidates[node.policy_state.queue] += node.evictable
        assert policy.queue_blocks == tuple(counts)
        if isinstance(policy, ArcPolicy):
            assert policy.queue_candidates == tuple(candidates)
            assert SHARE_BOUNDS[0] <= policy.recent_share <= SHARE_BOUNDS[1]
        else:
            assert SHARE_BOUNDS[0] <= policy.small_share <= SHARE_BOUNDS[1]


IndexMachine.TestCase.settings = machine_settings(200)
test_index_state_machine = IndexMachine.TestCase
