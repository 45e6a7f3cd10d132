"""What SGLang's dynamic HiCache storage backend loads:
`"module_path": "engine_shim.sglang_storage", "class_name": "KVSidecarStorage"`
(docs/engines.md). Importing it needs SGLang."""

from engine_shim.sglang.storage import KVSidecarStorage

__all__ = ["KVSidecarStorage"]
