"""Imported by engines: `from engine_shim import KVClient`.

`KVClient` needs torch; the protocol channel (`engine_shim.channel`) does
not, so tools such as `kvsidecar status` import it without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVClient", "PlanOps", "SidecarError", "SidecarUnavailable", "TransferHandle"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from engine_shim import client

        return getattr(client, name)
    raise AttributeError(f"module 'engine_shim' has no attribute {name!r}")
