"""TransferGraph: op ids, dependency and shape validation, engine/sidecar split."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sidecar.control.graph import OpKind, TransferGraph

ENGINE_KINDS = {OpKind.H2D, OpKind.D2H}


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.mark.parametrize("kind", list(OpKind))
def test_on_engine(kind):
    assert kind.on_engine is (kind in ENGINE_KINDS)


def test_add_assigns_ids_in_order_and_keeps_arrays():
    graph = TransferGraph()
    assert len(graph) == 0
    load = graph.add(OpKind.DISK2H, arr(7, 8), arr(1, 2))
    h2d = graph.add(OpKind.H2D, arr(1, 2), arr(30, 31), (load,))
    write = graph.add(OpKind.H2REMOTE, arr(1, 2), arr(0, 1), (load, h2d))
    assert (load, h2d, write) == (0, 1, 2)
    assert len(graph) == 3
    op = graph.ops[h2d]
    assert (op.op_id, op.kind, op.deps, op.num_blocks) == (1, OpKind.H2D, (0,), 2)
    assert op.src.tolist() == [1, 2] and op.dst.tolist() == [30, 31]
    assert graph.ops[write].deps == (0, 1)
    assert graph.ops[load].deps == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.deps = ()  # type: ignore[misc]


def test_empty_op_is_allowed():
    graph = TransferGraph()
    graph.add(OpKind.D2H, arr(), arr())
    assert graph.ops[0].num_blocks == 0


@pytest.mark.parametrize(
    "deps",
    [(0,), (1,), (-1,), (0, 5)],
    ids=["self", "future", "negative", "one-bad"],
)
def test_bad_dependencies_are_rejected_and_change_nothing(deps):
    graph = TransferGraph()
    if deps != (0,):
        graph.add(OpKind.D2H, arr(1), arr(2))
    before = list(graph.ops)
    with pytest.raises(ValueError, match="dependency"):
        graph.add(OpKind.H2DISK, arr(1), arr(2), deps)
    assert graph.ops == before


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (arr(1, 2, 3), arr(1, 2)),
        (arr(), arr(1)),
        (np.zeros((2, 2), np.int64), np.zeros((2, 2), np.int64)),
        (np.zeros((1, 2), np.int64), arr(1, 2)),
        (np.array(1), np.array(2)),
    ],
    ids=["longer-src", "empty-src", "2-d", "2-d-src", "0-d"],
)
def test_shape_mismatch_is_rejected(src, dst):
    graph = TransferGraph()
    with pytest.raises(ValueError, match="H2D"):
        graph.add(OpKind.H2D, src, dst)
    assert len(graph) == 0


def test_engine_and_sidecar_ops_partition_the_graph():
    graph = TransferGraph()
    kinds = [
        OpKind.D2H,
        OpKind.H2DISK,
        OpKind.H2REMOTE,
        OpKind.DISK2H,
        OpKind.H2D,
        OpKind.REMOTE2H,
        OpKind.H2D,
    ]
    for kind in kinds:
        graph.add(kind, arr(0), arr(0))
    assert [op.op_id for op in graph.engine_ops] == [0, 4, 6]
    assert [op.op_id for op in graph.sidecar_ops] == [1, 2, 3, 5]
    assert [op.op_id for op in graph.of_kind(OpKind.H2D)] == [4, 6]
    assert graph.of_kind(OpKind.D2H)[0].op_id == 0
    for kind in OpKind:
        assert len(graph.of_kind(kind)) == kinds.count(kind)
