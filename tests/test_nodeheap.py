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
    from sidecar.control._nodeheap import NodeHeap

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
    from sidecar.control._nodeheap import NodeHeap

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
    from sidecar.control._nodeheap import NodeHeap

    heap = NodeHeap()
    (node,) = nodes(1)
    for i in range(10_000):
        heap.push(node, float(i), 0.0, 0)
    assert heap.size == 1 and len(heap) <= 2 * heap.size + 1024 + 1
    assert heap.pop() is node and heap.pop() is None


@pytest.mark.parametrize("bad", [("x", 0.0, 0), (0.0, 0.0, 1.5), (0.0, 0.0, 2**70)])
def test_c_heap_rejects_bad_keys_and_changes_nothing(bad):
    from sidecar.control._nodeheap import NodeHeap

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

    from sidecar.control._nodeheap import NodeHeap

    monkeypatch.setattr(policies, "NodeHeap", NodeHeap)
    from_c = victims()
    monkeypatch.setattr(policies, "NodeHeap", LazyHeap)
    import sidecar.control.s3fifo as s3fifo

    monkeypatch.setattr(s3fifo, "NodeHeap", LazyHeap)
    assert victims() == from_c and from_c


class _Bomb:
    """A node whose heap_token read fails while `armed` (a RadixNode's never does)."""

    armed = False

    def __init__(self) -> None:
        self._token = None

    @property
    def heap_token(self):
        if _Bomb.armed:
            raise RuntimeError("token read failed")
        return self._token

    @heap_token.setter
    def heap_token(self, value) -> None:
        self._token = value


def test_a_failed_compaction_releases_each_stale_node_once():
    import sys

    from sidecar.control._nodeheap import NodeHeap

    heap, stale = NodeHeap(), []
    for i in range(1100):  # stale entries pile up until push compacts the array
        if i == 600:
            heap.push(_Bomb(), 5.0, 0.0, 0)
        node = nodes(1)[0]
        stale.append(node)
        heap.push(node, 1.0, 0.0, i)
        heap.remove(node)
        if len(heap) > 1020:
            break
    del node
    base = [sys.getrefcount(n) for n in stale]
    _Bomb.armed = True
    try:
        with pytest.raises(RuntimeError, match="token read failed"):
            for j in range(20):
                node = nodes(1)[0]
                heap.push(node, 1.0, 0.0, j)
                heap.remove(node)
    finally:
        _Bomb.armed = False
    del heap
    # The heap held one reference to each stale node; it must give back each exactly once.
    assert [sys.getrefcount(n) for n in stale] == [b - 1 for b in base]


REENTRANT_PUSH = """
from sidecar.control import _nodeheap
from sidecar.control._nodeheap import NodeHeap
print(_nodeheap.__file__)
heap = NodeHeap()
class Plain:
    __slots__ = ("heap_token",)
    def __init__(self): self.heap_token = None
class Reentrant:  # its token setter pushes into the same heap, at full capacity
    def __init__(self): self._t, self.fired = None, False
    @property
    def heap_token(self): return self._t
    @heap_token.setter
    def heap_token(self, v):
        self._t = v
        if not self.fired:
            self.fired = True
            heap.push(Plain(), 0.0, 0.0, 0)
keep = [Plain() for _ in range(1023)]
for p in keep:
    heap.push(p, 1.0, 0.0, 0)
heap.push(Reentrant(), 2.0, 0.0, 0)
assert len(heap) == 1025
print("ok")
"""


def test_a_push_from_a_token_setter_stays_inside_the_array(tmp_path):
    """Under AddressSanitizer (a build of its own in tmp_path): without room
    made after the node's attribute calls, the outer push writes past the end."""
    import shutil
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    libasan = subprocess.run(
        [gcc, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not Path(libasan).is_file():
        pytest.skip("no libasan")
    root = Path(__file__).resolve().parent.parent
    package = tmp_path / "sidecar" / "control"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer",
         f"-I{sysconfig.get_paths()['include']}", str(root / "sidecar" / "control" / "_nodeheap.c"),
         "-o", str(package / f"_nodeheap{suffix}")],
        check=True,
    )  # fmt: skip
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(tmp_path),
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0",
        "PYTHONMALLOC": "malloc",
    }
    done = subprocess.run(
        [sys.executable, "-c", REENTRANT_PUSH],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # the sanitized build, not the repository's
        timeout=120,
    )
    assert "AddressSanitizer" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(package / f"_nodeheap{suffix}"), "ok"]
