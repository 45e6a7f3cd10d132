"""The namespaces a sidecar has seen: numbers for (model, revision, tenant),
their configured limits, and what each uses of every tier.

The control plane tags every block with its namespace's number
(`sidecar.control`, "Namespaces" in docs/control-plane.md); number 0 is
blocks whose namespace is not known: recovered from SSD after a restart,
until an engine of their namespace registers (the journal records a tag of
each block's namespace) or a request of theirs extends them; a journal
written before the tags were recorded names none. Quotas are configured in
bytes and applied in blocks of each geometry's slot size (of its block
size in the remote tier), per tier and per
geometry (a namespace in two geometries may hold its quota in each: not a
quota across them, docs/sidecar.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from sidecar.namespace_limits import Limits, NamespaceName, Rule, limits_for
from sidecar.tiers.tiered import TieredCache

UNKNOWN = NamespaceName("(unknown)", "")
"""The name shown for namespace 0."""


class Namespaces:
    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self._ids: dict[NamespaceName, int] = {}
        self.names: dict[int, NamespaceName] = {0: UNKNOWN}
        self.limits: dict[int, Limits] = {}
        self.lookups: Counter[int] = Counter()
        """Per namespace: blocks asked for by lookups."""
        self.hits: Counter[int] = Counter()
        """Per namespace: of those, blocks found (in any tier)."""

    def knows(self, name: NamespaceName) -> bool:
        return name in self._ids

    def __len__(self) -> int:
        """Namespaces seen so far."""
        return len(self._ids)

    def id_of(self, name: NamespaceName) -> int:
        """The namespace's number, given on first sight (from 1)."""
        ns = self._ids.get(name)
        if ns is None:
            ns = self._ids[name] = len(self.names)
            self.names[ns] = name
            self.limits[ns] = limits_for(self.rules, name)
        return ns

    @property
    def has_ttl(self) -> bool:
        return any(limits.ttl is not None for limits in self.limits.values())

    def apply(self, realm: TieredCache, ns: int) -> None:
        """Set namespace `ns`'s quotas and TTL on a geometry's tiers, after
        giving it the blocks its SSD tier recovered as the namespace's (the
        journal records a tag of each block's namespace name): a quota then
        evicts what is over it, and a TTL counts from their writes."""
        name = self.names.get(ns)
        if name is None or not ns:
            return
        if realm.ssd is not None:
            tag = name.tag()
            realm.ssd.ns_tags[ns] = tag
            realm.claim_recovered(ns, tag)
        limits = self.limits[ns]
        tiers = {"cpu": realm.cache.cpu, **realm.cache.lower}
        for tier, nbytes in limits.quota_bytes.items():
            if tier in tiers:
                block = realm.layout.block_bytes if tier == "remote" else realm.layout.slot_stride
                realm.cache.set_quota(tier, ns, nbytes // block)
        if limits.ttl is not None:
            realm.cache.set_ttl(ns, limits.ttl)

    def select(self, model: str, revision: str, tenant: str) -> list[int]:
        """The numbers of the namespaces matching (an empty field matches any);
        with no field given, every namespace, 0 included."""
        if not (model or revision or tenant):
            return sorted(self.names)
        return [
            ns
            for ns, name in self.names.items()
            if ns
            and (not model or name.model == model)
            and (not revision or name.revision == revision)
            and (not tenant or name.tenant == tenant)
        ]

    def figures(self, realms: Iterable[TieredCache]) -> list[dict[str, Any]]:
        """Per namespace holding blocks or seen by a lookup: its name, limits,
        and per tier its blocks and bytes over every geometry (a slot's bytes
        a block, the block's own in the remote tier: what its quota counts)."""
        usage: dict[int, dict[str, list[int]]] = {}
        for realm in realms:
            for tier, blocks in realm.cache.namespace_usage().items():
                size = realm.layout.block_bytes if tier == "remote" else realm.layout.slot_stride
                for ns, n in blocks.items():
                    counts = usage.setdefault(ns, {}).setdefault(tier, [0, 0])
                    counts[0] += n
                    counts[1] += n * size
        out = []
        for ns in sorted(usage.keys() | self.lookups.keys()):
            name, limits = self.names[ns], self.limits.get(ns, Limits())
            out.append(
                {
                    "id": ns,
                    "model": name.model,
                    "revision": name.revision,
                    "tenant": name.tenant,
                    "tiers": {
                        tier: {"blocks": b, "bytes": nbytes}
                        for tier, (b, nbytes) in usage.get(ns, {}).items()
                    },
                    "quota_bytes": dict(limits.quota_bytes),
                    "ttl_seconds": limits.ttl,
                    "lookup_blocks": self.lookups[ns],
                    "hit_blocks": self.hits[ns],
                }
            )
        return out
