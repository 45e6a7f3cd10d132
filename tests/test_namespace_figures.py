"""What `kvsidecar namespaces` and Prometheus say of each namespace: bytes
as its quotas count them, and counters that never go down."""

from __future__ import annotations

from types import SimpleNamespace

from sidecar.metrics.prometheus import MAX_LABELED_NAMESPACES, _namespace_metrics
from sidecar.namespace_limits import NamespaceName, parse_rules
from sidecar.server.namespaces import Namespaces


def realm(usage: dict[str, dict[int, int]], block_bytes: int, slot_stride: int):
    """A geometry as `Namespaces.figures` reads it: its layout's sizes and
    its tiers' blocks per namespace."""
    layout = SimpleNamespace(block_bytes=block_bytes, slot_stride=slot_stride)
    return SimpleNamespace(layout=layout, cache=SimpleNamespace(namespace_usage=lambda: usage))


def test_remote_bytes_count_blocks_as_the_remote_quota_does():
    spaces = Namespaces(parse_rules(["tenant=t remote=8KiB"]))
    ns = spaces.id_of(NamespaceName("m", "", "t"))
    # 512-byte blocks in 4 KiB slots: the remote quota of 8 KiB is 16 blocks.
    (row,) = spaces.figures([realm({"cpu": {ns: 2}, "remote": {ns: 16}}, 512, 4096)])
    assert row["tiers"] == {
        "cpu": {"blocks": 2, "bytes": 8192},
        "remote": {"blocks": 16, "bytes": 8192},
    }
    assert row["tiers"]["remote"]["bytes"] <= row["quota_bytes"]["remote"]


def counters(rows: list[dict]) -> dict[str, float]:
    """model -> lookup blocks counter, per labelled series."""
    (_, asked, _) = _namespace_metrics(rows)
    return {s.labels["model"]: s.value for s in asked.samples if s.name.endswith("_total")}


def test_a_namespace_never_moves_between_its_label_and_other():
    spaces = Namespaces([])
    ids = [spaces.id_of(NamespaceName(f"m{i}", "", "")) for i in range(MAX_LABELED_NAMESPACES + 8)]
    for ns in ids:
        spaces.lookups[ns] += 10
    before = counters(spaces.figures([realm({"cpu": {ns: 1000 - ns for ns in ids}}, 512, 4096)]))
    # The namespaces numbered last now hold the most bytes: the series stay.
    after = counters(spaces.figures([realm({"cpu": {ns: 1000 * ns for ns in ids}}, 512, 4096)]))
    assert before.keys() == after.keys()
    assert all(after[k] >= before[k] for k in before)
    assert before["_other"] == 10 * 8 and len(before) == MAX_LABELED_NAMESPACES + 1
