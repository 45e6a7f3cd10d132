"""Per-namespace limits from the configuration: byte quotas per tier and a TTL.

A namespace is what engines register as (model, revision, tenant). The
`namespace_limits` key is a list of entries, each of space-separated
`name=value` tokens: a selector (`model=`, `revision=`, `tenant=`; any left
out matches every value) and at least one limit (`cpu=`, `ssd=`, `remote=`
sizes, `ttl=` seconds). For example:

    namespace_limits:
      - model=meta-llama/Llama-3.1-8B-Instruct tenant=acme cpu=4GiB ssd=50GiB
      - tenant=trial cpu=512MiB ttl=600

Every entry that matches a namespace applies, later ones over earlier ones,
limit by limit.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sidecar.config_spec import parse_size

SELECTORS = ("model", "revision", "tenant")
TIERS = ("cpu", "ssd", "remote")


@dataclass(frozen=True)
class NamespaceName:
    """What an engine registers as; the unit of quotas, TTLs and `clear`."""

    model: str
    revision: str
    tenant: str = ""

    def describe(self) -> str:
        tenant = f" tenant {self.tenant!r}" if self.tenant else ""
        return f"{self.model}@{self.revision}{tenant}"

    def tag(self) -> bytes:
        """8 bytes naming this namespace in the SSD journal's records (a
        BLAKE2b of the three fields): what lets a restarted sidecar give
        recovered blocks back to their namespace."""
        named = json.dumps([self.model, self.revision, self.tenant]).encode()
        return hashlib.blake2b(named, digest_size=8, person=b"kvsidecar-ns").digest()


@dataclass(frozen=True)
class Limits:
    quota_bytes: dict[str, int] = field(default_factory=dict)
    """Tier -> the most bytes of the namespace's blocks it keeps."""
    ttl: float | None = None
    """Seconds a block is served and kept after it was stored (None: no limit)."""


@dataclass(frozen=True)
class Rule:
    selector: dict[str, str]
    limits: Limits

    def matches(self, name: NamespaceName) -> bool:
        return all(getattr(name, key) == value for key, value in self.selector.items())


def parse_rules(entries: Sequence[str]) -> list[Rule]:
    """The rules of `namespace_limits`; ValueError naming the bad entry."""
    return [_parse(entry) for entry in entries]


def limits_for(rules: Sequence[Rule], name: NamespaceName) -> Limits:
    """Every matching rule, later ones over earlier ones."""
    quotas: dict[str, int] = {}
    ttl = None
    for rule in rules:
        if rule.matches(name):
            quotas.update(rule.limits.quota_bytes)
            ttl = rule.limits.ttl if rule.limits.ttl is not None else ttl
    return Limits(quotas, ttl)


MAX_TTL_SECONDS = 1e9
"""~31 years: a remote value's expiry (SET PX, in ms) stays one Redis takes."""
MAX_QUOTA_BYTES = 1 << 60
"""1 EiB: far past any tier, and within the int64 a stats reply carries."""


def _parse(entry: str) -> Rule:
    selector: dict[str, str] = {}
    quotas: dict[str, int] = {}
    ttl = None
    for token in entry.split():
        key, sep, value = token.partition("=")
        if not sep or not value:
            raise ValueError(f"{entry!r}: {token!r} is not NAME=VALUE")
        if key in selector or key in quotas or (key == "ttl" and ttl is not None):
            raise ValueError(f"{entry!r}: {key} given twice")
        if key in SELECTORS:
            selector[key] = value
        elif key in TIERS:
            quotas[key] = parse_size(value)
            if quotas[key] > MAX_QUOTA_BYTES:
                raise ValueError(f"{entry!r}: {key} quota over 1 EiB")
        elif key == "ttl":
            try:
                ttl = float(value)
            except ValueError:
                raise ValueError(f"{entry!r}: ttl {value!r} is not a number of seconds") from None
            if not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL_SECONDS):
                raise ValueError(
                    f"{entry!r}: ttl must be a positive number of seconds, at most 1e9"
                )
        else:
            allowed = ", ".join((*SELECTORS, *TIERS, "ttl"))
            raise ValueError(f"{entry!r}: unknown name {key!r}; allowed: {allowed}")
    if not quotas and ttl is None:
        raise ValueError(f"{entry!r}: no limit (cpu=, ssd=, remote= or ttl=)")
    return Rule(selector, Limits(quotas, ttl))
