"""The C index (router.native) against the Python radix tree as the model:
random runs of stores, removals, clears, worker removals and sweeps, with
more than 64 workers (holder slots past the inline bitmap word) and keys
that share their first 8 bytes, must give the same answers, the same errors
and the same dumps."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.index import KvIndex, RouterIndexError, make_index
from router.keys import BlockKey, Worker, worker
from router.radix import RadixTreeIndex

pytest.importorskip("router._cindex")

KEYS = 24


def key(i: int) -> BlockKey:
    """Keys 0-6, 7-13, ... share their first 8 bytes."""
    return BlockKey((i % 7).to_bytes(8, "little") + (i // 7).to_bytes(8, "little"))


workers_ = st.builds(worker, st.integers(0, 79), st.integers(0, 1))
ops = st.one_of(
    st.tuples(
        st.just("store"), workers_, st.booleans(), st.integers(0, 50),
        st.lists(st.integers(0, KEYS - 1), max_size=5),
    ),
    st.tuples(st.just("remove"), workers_, st.lists(st.integers(0, KEYS - 1), max_size=3)),
    st.tuples(st.just("remove_held"), workers_, st.integers(0, 50)),
    st.tuples(st.just("clear"), workers_),
    st.tuples(st.just("clear_rank"), workers_),
    st.tuples(st.just("remove_worker"), st.integers(0, 79)),
    st.tuples(st.just("add_workers"), st.integers(0, 79)),
    st.tuples(st.just("sweep"), st.integers(0, 6)),
)  # fmt: skip


def held(tree: RadixTreeIndex, w: Worker) -> list[BlockKey]:
    holder = tree._holder.get(w)
    return [] if holder is None else list(tree._held[holder])


def apply(idx: KvIndex, op: tuple, tree: RadixTreeIndex) -> None:
    kind = op[0]
    if kind == "store":
        _, w, with_parent, pick, ids = op
        mine = held(tree, w)
        parent = mine[pick % len(mine)] if with_parent and mine else None
        idx.apply_stored(w, [key(i) for i in ids], parent)
    elif kind == "remove":
        idx.apply_removed(op[1], [key(i) for i in op[2]])
    elif kind == "remove_held":
        mine = held(tree, op[1])
        idx.apply_removed(op[1], mine[op[2] % len(mine) :] if mine else [])
    elif kind == "clear":
        idx.apply_cleared(op[1])
    elif kind == "clear_rank":
        idx.clear_rank(op[1])
    elif kind == "remove_worker":
        idx.remove_worker(op[1])
    elif kind == "add_workers":
        for i in range(op[1], 80):
            idx.add_worker(worker(i))
    else:
        idx.sweep(op[1])


def chains(tree: RadixTreeIndex) -> list[list[BlockKey]]:
    """Every known key's chain from the root, plus a key after it."""
    out = []
    for node in tree._nodes.values():
        chain: list[BlockKey] = []
        while node.key is not None:
            chain.append(node.key)
            assert node.parent is not None
            node = node.parent
        out.append([*reversed(chain), key(len(chain) % KEYS)])
    return out


def dumped(idx: KvIndex) -> tuple:
    d = idx.dump()
    return d.workers, sorted(d.entries)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=60))
def test_native_index_answers_as_the_tree_model(run: list[tuple]) -> None:
    tree = RadixTreeIndex()
    native = make_index("native")
    for step, op in enumerate(run):
        errors = []
        for idx in (native, tree):  # native first: `apply` reads tree's state
            try:
                apply(idx, op, tree)
                errors.append(None)
            except RouterIndexError as exc:
                errors.append(type(exc))
        assert errors[0] == errors[1], (step, op)
        assert native.workers() == tree.workers(), (step, op)
        assert native.stale_blocks == tree.stale_blocks, (step, op)
        for query in chains(tree):
            for early in (False, True):
                assert native.find_matches(query, early) == tree.find_matches(query, early)
    assert dumped(native) == dumped(tree)
    copy = make_index("native")
    copy.restore(native.dump())
    assert dumped(copy) == dumped(tree)
    for query in chains(tree):
        assert copy.find_matches(query) == tree.find_matches(query)


def test_slots_past_the_first_bitmap_word_are_retired_swept_and_reused() -> None:
    """150 workers sharing a prefix (slots 0-149: three bitmap words), every
    other one removed, swept in small slices, then new workers reuse the
    swept slots; the answers stay the model's throughout."""
    tree, native = RadixTreeIndex(), make_index("native")
    prefix = [key(i) for i in range(KEYS)]
    for idx in (tree, native):
        for w in range(150):
            idx.apply_stored(worker(w), prefix[: 1 + w % KEYS], None)
    assert native.find_matches(prefix) == tree.find_matches(prefix)
    for idx in (tree, native):
        for w in range(0, 150, 2):
            idx.remove_worker(w)
    assert native.find_matches(prefix) == tree.find_matches(prefix)
    while native.sweep(7):
        assert native.find_matches(prefix) == tree.find_matches(prefix)
    tree.sweep_all()
    assert native.stale_blocks == tree.stale_blocks == 0
    for idx in (tree, native):
        for w in range(200, 280):
            idx.apply_stored(worker(w), prefix[: 1 + w % KEYS], None)
    assert native.find_matches(prefix) == tree.find_matches(prefix)
    assert dumped(native) == dumped(tree)
