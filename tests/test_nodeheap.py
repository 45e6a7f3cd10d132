"""NodeHeap (C) against LazyHeap (the pure-Python reference): same pops, same sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.control import policies
from sidecar.control.node import RadixNode
from sidecar.control.policies import LazyHeap


def test_the_c_heap_is_built():
    """setup.py builds it wherever a C compiler is (CI included); without it
    eviction stays correct but slows down on large indexes."""
    from sidecar._nodeheap import NodeHeap

    assert policies.NodeHeap is NodeHeap


def nodes(n: int) -> list[RadixNode]:
    return [RadixNode(b"", np.empty(0, dtype=np.int64), None, True, 0.0, i) for i in range(n)]


def birth(node: RadixNode | None) -> int | None:
    return None if node is None else node.birth


OPS = st.lists(
    st.tuples(
        st.sampled_from(["push", "push", "push", "remove", "pop"]),
        st.integers(0, 7),  # node
        st.sampled_from([0.0, 1.0, -2.5, 3.0]),
        st.sampled_from([0.0, 1.0]),
        st.integers(-3, 3),
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_c_heap_matches_the_reference(ops):
    from sidecar._nodeheap import NodeHeap

    ref_nodes, c_nodes = nodes(8), nodes(8)
    ref, c = LazyHeap(), NodeHeap()
    for op, i, k0, k1, k2 in ops:
        if op == "push":
            ref.push(ref_nodes[i], k0, k1, k2)
            c.push(c_nodes[i], k0, k1, k2)
        elif op == "remove":
            ref.remove(ref_nodes[i])
            c.remove(c_nodes[i])
        else:
            a, b = ref.pop(), c.pop()
            assert birth(a) == birth(b)
        assert ref.size == c.size
        assert [n.heap_token is None for n in ref_nodes] == [n.heap_token is None for n in c_nodes]
    while (a := ref.pop()) is not None:
        b = c.pop()
        assert b is not None and a.birth == b.birth
    assert c.pop() is None and c.size == 0


def test_c_heap_compacts_stale_entries():
    from sidecar._nodeheap import NodeHeap

    heap = NodeHeap()
    (node,) = nodes(1)
    for i in range(10_000):
        heap.push(node, float(i), 0.0, 0)
    assert heap.size == 1 and len(heap) <= 2 * heap.size + 1024 + 1
    assert heap.pop() is node and heap.pop() is None


@pytest.mark.parametrize("bad", [("x", 0.0, 0), (0.0, 0.0, 1.5), (0.0, 0.0, 2**70)])
def test_c_heap_rejects_bad_keys_and_changes_nothing(bad):
    from sidecar._nodeheap import NodeHeap

    heap = NodeHeap()
    (node,) = nodes(1)
    with pytest.raises((TypeError, OverflowError)):
        heap.push(node, *bad)
    assert heap.size == 0 and len(heap) == 0 and node.heap_token is None


@pytest.mark.parametrize("name", policies.POLICY_NAMES)
def test_every_policy_evicts_in_the_same_order_on_either_heap(name, monkeypatch):
    """The same random workload through both heaps evicts the same blocks in
    the same order."""
    from helpers import FakeClock, keys, make_index

    def victims() -> list[list[int]]:
        rng = np.random.default_rng(7)
        clock = FakeClock()
        index = make_index(name, clock)
        order: list[list[int]] = []
        slot = 0
        for step in range(400):
            clock.set(float(step // 3))
            base = int(rng.integers(0, 40))
            seq = keys(*range(base * 10, base * 10 + int(rng.integers(1, 6))))
            present = index.match(seq, touch=True).num_blocks
            if present < len(seq):
                new = np.arange(slot, slot + len(seq) - present)
                slot += len(new)
                index.insert(seq, new, ready=True)
            if step % 5 == 4:
                order += [r.slots.tolist() for r in index.evict(3).runs]
        return order

    from sidecar._nodeheap import NodeHeap

    monkeypatch.setattr(policies, "NodeHeap", NodeHeap)
    from_c = victims()
    monkeypatch.setattr(policies, "NodeHeap", LazyHeap)
    import sidecar.control.s3fifo as s3fifo

    monkeypatch.setattr(s3fifo, "NodeHeap", LazyHeap)
    assert victims() == from_c and from_c
