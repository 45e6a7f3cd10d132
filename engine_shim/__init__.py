"""Imported by engines: `from engine_shim import KVClient`.

`KVClient` needs torch; the protocol channel (`engine_shim.channel`) does
not, so tools such as `kvsidecar status` import it without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "KVClient": "engine_shim.client",
    "PlanOps": "engine_shim.transfer",
    "TransferHandle": "engine_shim.transfer",
    "SidecarError": "engine_shim.channel",
    "SidecarUnavailable": "engine_shim.channel",
}
__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'engine_shim' has no attribute {name!r}")
