"""SGLang's HiCache L3 storage backend (`storage.KVSidecarStorage`, which
SGLang loads as `engine_shim.sglang_storage.KVSidecarStorage`) and its
parts that need no SGLang: the extra config (`settings`), the host pool's
pages as planes (`geometry`), the keys of a call (`keys`) and the
per-thread clients (`clients`). Only `storage` imports SGLang."""
