"""`StorageSettings`: the backend's configuration, read once from SGLang's
`--hicache-storage-backend-extra-config` and passed down as values.

    {"backend_name": "kvsidecar", "module_path": "engine_shim.sglang_storage",
     "class_name": "KVSidecarStorage", "interface_v1": 1,
     "hicache_storage_pass_prefix_keys": true,
     "model_revision": "weights-sha256", "model_name": "llama-3-8b",
     "tenant": "", "endpoint": "ipc:///run/user/1000/kvsidecar/default.sock",
     "timeout": 1.0}

`model_revision` is required; the rest of kvsidecar's keys are optional.
The keys SGLang itself reads from the same object (the dynamic backend's
three, `interface_v1`, the prefetch knobs) are allowed and left to it, but
`interface_v1` must be on: without it SGLang copies every page through a
temporary tensor and calls the legacy methods, which this backend does not
serve. An unknown key or a value of the wrong type is a ValueError that
names the key, so a typo never silently runs with defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_shim.channel import timeout_problem

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "hicache_storage_pass_prefix_keys",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
    }
)
"""Keys of the extra config that SGLang reads (and mostly removes) itself."""

OWN_KEYS = ("model_name", "model_revision", "tenant", "endpoint", "timeout", "admin_token_file")


class ConfigError(ValueError):
    """The extra config is wrong: the message names the key."""


@dataclass(frozen=True)
class StorageSettings:
    model_name: str
    """Namespace: the model (SGLang's served model name unless `model_name` is given)."""
    model_revision: str
    """Namespace: the weights' revision or a fingerprint of them, so KV of
    old weights is never served for new ones under the same model name."""
    tenant: str = ""
    """Namespace salt isolating tenants that share a model."""
    endpoint: str | None = None
    """The sidecar; None: where `kvsidecar serve` listens by default."""
    timeout: float = 1.0
    """Seconds to wait for the sidecar before a call counts as a miss / failed set."""
    admin_token_file: str | None = None
    """The sidecar's admin token, for `clear`; None: `<instance>.admin`
    beside an ipc:// endpoint's socket."""

    def __post_init__(self) -> None:
        for name in ("model_name", "model_revision"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.tenant, str):
            raise ConfigError(f"tenant must be a string, got {self.tenant!r}")
        for name in ("endpoint", "admin_token_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        if self.endpoint is not None and not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"endpoint must start with ipc:// or tcp://, got {self.endpoint!r}")
        problem = timeout_problem(self.timeout)
        if problem is not None:
            raise ConfigError(problem)

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, *, model_name: str | None
    ) -> StorageSettings:
        """Settings from the extra config; its `model_name` overrides SGLang's."""
        if extra is None:
            raise ConfigError(
                "the kvsidecar backend needs --hicache-storage-backend-extra-config "
                "(at least model_revision and interface_v1: 1)"
            )
        if not isinstance(extra, Mapping):
            raise ConfigError(f"the extra config must be a JSON object, got {extra!r}")
        unknown = sorted(str(k) for k in set(extra) - SGLANG_KEYS - set(OWN_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown extra config keys {unknown}: kvsidecar reads {sorted(OWN_KEYS)}"
            )
        if not _truthy(extra.get("interface_v1")):
            raise ConfigError(
                'interface_v1 must be 1 ("interface_v1": 1): kvsidecar copies pages between '
                "SGLang's host pool and its shared memory itself, through the zero-copy calls"
            )
        if "model_revision" not in extra:
            raise ConfigError(
                "model_revision is required: the weights' revision or a fingerprint of "
                "them, so KV of old weights is never served for new ones"
            )
        own = {k: extra[k] for k in OWN_KEYS if k in extra}
        own.setdefault("model_name", model_name)
        if not own["model_name"]:
            raise ConfigError("model_name is required: SGLang gave the backend none")
        return cls(**own)


def _truthy(value: object) -> bool:
    return value is True or (type(value) is int and value != 0) or value in ("1", "true")
