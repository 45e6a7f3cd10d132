"""An administrator's ops: `Clear` (`kvsidecar clear`).

Who may administer is whoever shows the sidecar's admin token
(`sidecar.runtime.AdminToken`: a file only the sidecar's user and root can
read); docs/sidecar.md, "Security".
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter
from collections.abc import Mapping

from contract import protocol as p
from contract import replies as r
from contract.ids import KEY_BYTES
from contract.protocol import ErrorCode, ProtocolError
from shm.layout import BlockLayout
from sidecar.server.namespaces import Namespaces
from sidecar.tiers.tiered import TieredCache

log = logging.getLogger("kvsidecar")

TIER_NAMES = ("cpu", "ssd", "remote")


class Admin:
    def __init__(
        self, token: str, namespaces: Namespaces, realms: Mapping[BlockLayout, TieredCache]
    ) -> None:
        """`realms`: every geometry's cache (the handlers' live mapping)."""
        self._token = token.encode()
        self._namespaces = namespaces
        self._realms = realms

    def clear(self, req: p.Clear) -> r.ClearReply:
        """Drop the blocks the request selects from the tiers it names; the
        remote store's values of those this sidecar knows are deleted in the
        background. Raises ProtocolError (FORBIDDEN without the token,
        BAD_VALUE for an unknown tier) before changing anything."""
        if not hmac.compare_digest(req.token.encode(), self._token):
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                "clear needs this sidecar's admin token (kvsidecar clear reads it from the "
                "runtime directory, as the sidecar's user)",
            )
        if req.tier not in ("", *TIER_NAMES):
            raise ProtocolError(
                ErrorCode.BAD_VALUE,
                f"tier must be one of {', '.join(TIER_NAMES)}, not {req.tier!r}",
            )
        selected = self._namespaces.select(req.model, req.revision, req.tenant)
        everything = not (req.model or req.revision or req.tenant)
        removed: Counter[str] = Counter()
        kept: Counter[str] = Counter()
        for realm in self._realms.values():
            for name, tier in {"cpu": realm.cache.cpu, **realm.cache.lower}.items():
                if req.tier and name != req.tier:
                    continue
                keys: list[bytes] | None = [] if name == "remote" else None
                if everything:
                    dropped, left = tier.clear(keys)
                else:
                    dropped = left = 0
                    for ns in selected:
                        d, k = tier.clear_namespace(ns, keys)
                        dropped, left = dropped + d, left + k
                removed[name] += dropped
                kept[name] += left
                if keys and realm.remote is not None:  # the store's values go too
                    realm.remote.purge([k for run in keys for k in _split_keys(run)])
        log.warning(
            "cleared %s of %s: %s (kept, in use: %s)",
            req.tier or "every tier",
            "every namespace" if everything else f"{len(selected)} namespace(s)",
            dict(removed),
            dict(kept),
        )
        return r.ClearReply(
            id=req.id, removed=dict(removed), kept=dict(kept), namespaces=len(selected)
        )


def _split_keys(run: bytes) -> list[bytes]:
    """A run's keys (16 bytes each, back to back), one by one."""
    return [run[i : i + KEY_BYTES] for i in range(0, len(run), KEY_BYTES)]
