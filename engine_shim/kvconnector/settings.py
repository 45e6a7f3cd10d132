"""`ConnectorSettings`: the connector's configuration, read once from
vLLM's `kv_connector_extra_config` and passed down as values.

    {"endpoint": "ipc:///run/user/1000/kvsidecar/default.sock",
     "model_revision": "weights-sha256", "tenant": "", "block_keys": "auto",
     "load_async": true, "lookup_async": true, "layer_wise": false,
     "timeout": 1.0}

Every key is optional; an unknown key or a value of the wrong type is a
ValueError that names the key, so a typo never silently runs with defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from engine_shim.channel import timeout_problem

BLOCK_KEYS = ("auto", "engine", "tokens")
LAYER_WISE_DEFAULT = False
"""`layer_wise`'s default: the faster on `kvsidecar bench connector`
(docs/engines.md): on CPU one copy per step saved 0.1-0.3 ms a step over
layer-wise saves; synchronous loads were within the noise either way."""


@dataclass(frozen=True)
class ConnectorSettings:
    model_name: str
    """Namespace: the model (vLLM's `--model` unless `model_name` is given)."""
    model_revision: str
    """Namespace: the weights' revision; set it, or KV of old weights is
    served for new ones under the same model name."""
    engine_id: str
    """Shared by the scheduler and the workers of one vLLM instance."""
    endpoint: str | None = None
    """The sidecar; None: where `kvsidecar serve` listens by default."""
    tenant: str = ""
    """Namespace salt isolating tenants that share a model."""
    block_keys: str = "auto"
    """"engine": key blocks from vLLM's block hashes; "tokens": hash the
    tokens; "auto": vLLM's hashes when they are shareable (see the glue)."""
    load_async: bool = True
    """Load between scheduler steps (True) or during the forward, layer by layer."""
    lookup_async: bool = True
    """Answer "ask again" while a lookup is in flight instead of blocking."""
    layer_wise: bool = LAYER_WISE_DEFAULT
    """Copy each layer as the forward reaches it (`save_kv_layer`: a save's
    layer as soon as it is computed; `wait_for_layer_load`: a synchronous
    load's layer just before it is read), else one copy per step (saves
    after the forward, synchronous loads before it). The default is the
    faster on `kvsidecar bench connector` (docs/engines.md)."""
    timeout: float = 1.0
    """Seconds to wait for the sidecar before treating it as down."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            empty = not value and f.name != "tenant"
            if f.type == "str" and (not isinstance(value, str) or empty):
                raise ValueError(f"{f.name} must be a non-empty string, got {value!r}")
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be true or false, got {value!r}")
        if self.endpoint is not None and (not isinstance(self.endpoint, str) or not self.endpoint):
            raise ValueError(f"endpoint must be a non-empty string, got {self.endpoint!r}")
        if self.block_keys not in BLOCK_KEYS:
            raise ValueError(f"block_keys must be one of {BLOCK_KEYS}, got {self.block_keys!r}")
        problem = timeout_problem(self.timeout)
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None,
        *,
        model_name: str,
        model_revision: str,
        engine_id: str,
    ) -> ConnectorSettings:
        """Settings from `kv_connector_extra_config`; its `model_name` and
        `model_revision` override the engine's."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)} - {"engine_id"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}: use {sorted(known)}"
            )
        extra.setdefault("model_name", model_name)
        extra.setdefault("model_revision", model_revision)
        return cls(engine_id=engine_id, **extra)
