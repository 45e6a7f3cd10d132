"""`KVSidecarConnector`: kvsidecar as vLLM's KV connector (vLLM v1's
`KVConnectorBase_V1`, written against vLLM 0.33).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVSidecarConnector",
        "kv_connector_module_path": "engine_shim.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"model_revision": "weights-sha256"}}'

This module imports without vLLM: the class is built, subclassing vLLM's
base, the first time `KVSidecarConnector` is looked up (as vLLM's factory
does). The logic lives in `engine_shim.kvconnector`; here vLLM's config is
read once into its settings and geometry, and every hook is forwarded.

Supported: any tensor-parallel size (ranks on one host, one sidecar), PP=1,
one KV cache group of full attention (MLA included: one copy stored, loaded
into every rank), every KV cache layout (`VLLM_KV_CACHE_LAYOUT`:
layer-compact, head-outer LHBNC, cross-layer) and padded pages.
Sliding-window models run with vLLM's hybrid allocator off (vLLM turns it
off for a connector that is not `SupportsHMA`), which gives one group of
full attention; a model that still has several groups (Mamba hybrids, or
`--enable-hybrid-kv-cache-manager`) is refused naming them. Anything else is
refused with a ValueError when vLLM creates the connector. Transfers are
one copy per step, or layer by layer with `"layer_wise": true`
(`save_kv_layer`, `wait_for_layer_load`; docs/engines.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.parallel import Parallel
from engine_shim.kvconnector.settings import LAYER_WISE_DEFAULT, ConnectorSettings

log = logging.getLogger(__name__)

TARGET_VLLM = "0.33"
FULL_ATTENTION = ("FullAttentionSpec", "MLAAttentionSpec")
SHAREABLE_HASH_ALGOS = ("sha256", "sha256_cbor")
"""vLLM hash algorithms collision-resistant enough to key a shared cache
(xxhash is not). Their hashes are the same in every process only with
PYTHONHASHSEED set: else vLLM starts every chain from random bytes drawn
per process (`init_none_hash`)."""

__all__ = [  # noqa: F822
    "KVSidecarConnector",
    "geometry_of",
    "parallel_of",
    "settings_of",
    "uses_block_hashes",
]


def __getattr__(name: str) -> Any:
    if name == "KVSidecarConnector":
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def settings_of(vllm_config: Any) -> ConnectorSettings:
    """The connector settings of a vLLM config; ValueError for a deployment
    this connector does not support."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "KVSidecarConnector does not support pipeline parallelism "
            f"(pipeline_parallel_size={parallel.pipeline_parallel_size}): use "
            "--pipeline-parallel-size 1 (tensor parallelism of any size is supported)"
        )
    transfer = vllm_config.kv_transfer_config
    model = vllm_config.model_config
    dp_rank = getattr(parallel, "data_parallel_rank", 0) or 0
    return ConnectorSettings.from_extra_config(
        transfer.kv_connector_extra_config,
        model_name=model.model,
        model_revision=model.revision or "unpinned",
        engine_id=f"vllm-{transfer.engine_id}-dp{dp_rank}",
    )


def parallel_of(vllm_config: Any, kv_cache_config: Any, role_is_worker: bool) -> Parallel:
    """This process's place among the engine's TP ranks (the scheduler's: rank 0)."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    one_copy = type(kv_cache_config.kv_cache_groups[0].kv_cache_spec).__name__ == (
        "MLAAttentionSpec"
    )
    rank = 0
    if role_is_worker and tp_size > 1:
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise ValueError(
                f"KVSidecarConnector: tensor_parallel_size={tp_size} but vLLM's "
                "tensor-parallel group is not initialized in this worker"
            )
        rank = parallel_state.get_tensor_model_parallel_rank()
    return Parallel(tp_rank=rank, tp_size=tp_size, one_copy=one_copy)


def geometry_of(kv_cache_config: Any, vllm_config: Any) -> KVGeometry:
    """The KV geometry of vLLM's KV cache config: one group of full attention
    (MLA included), in any KV cache layout; a padded page counts its payload."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    others = [
        f"group {i} ({kind}, layers {g.layer_names[0]}..)"
        for i, (g, kind) in enumerate(zip(groups, kinds, strict=True))
        if kind not in FULL_ATTENTION
    ]
    if len(groups) != 1 or others:
        raise ValueError(
            "KVSidecarConnector caches one KV cache group of full attention; this model has "
            f"{len(groups)} groups ({', '.join(kinds)}); not cacheable: "
            f"{', '.join(others) or 'the groups past the first'}. Leave vLLM's hybrid KV "
            "cache manager off (the default with this connector) for sliding-window models"
        )
    spec = groups[0].kv_cache_spec
    layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    itemsize = torch.empty(0, dtype=spec.dtype).element_size()
    return KVGeometry(
        layout=str(layout),
        num_layers=len(groups[0].layer_names),
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=spec.dtype,
        block_elems=getattr(spec, "real_page_size_bytes", spec.page_size_bytes) // itemsize,
    )


def uses_block_hashes(settings: ConnectorSettings, vllm_config: Any, block_size: int) -> bool:
    """Whether blocks are keyed from vLLM's block hashes (`block_keys`):
    "auto" takes them when they are one per block, collision-resistant and
    the same in every process (sha256 or sha256_cbor with PYTHONHASHSEED
    set), so two engines (or a restarted one) share the cache; otherwise
    the tokens are hashed."""
    cache = vllm_config.cache_config
    hash_block_size = getattr(cache, "hash_block_size", None) or block_size
    if settings.block_keys == "tokens":
        return False
    if hash_block_size != block_size:
        if settings.block_keys == "engine":
            raise ValueError(
                f"block_keys 'engine' needs vLLM's hash block size ({hash_block_size}) "
                f"to equal the KV block size ({block_size})"
            )
        return False
    if settings.block_keys == "engine":
        if os.environ.get("PYTHONHASHSEED") is None:
            log.warning(
                "kvsidecar: block_keys 'engine' without PYTHONHASHSEED: vLLM's block hashes "
                "differ in every process, so no other or restarted engine will hit this cache"
            )
        return True
    strong = cache.prefix_caching_hash_algo in SHAREABLE_HASH_ALGOS
    return strong and os.environ.get("PYTHONHASHSEED") is not None


def _connector_class() -> type:
    """KVSidecarConnector, subclassing vLLM's base (imported here, lazily)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from engine_shim.kvconnector.scheduler import SchedulerSide
    from engine_shim.kvconnector.worker import WorkerSide

    class KVSidecarConnector(KVConnectorBase_V1):  # type: ignore[misc]
        """kvsidecar's vLLM KV connector; see engine_shim.vllm_connector."""

        _cache_hit_source = CacheHitSource.HOST

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            settings = settings_of(vllm_config)
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
                log.warning(
                    "kvsidecar: kv_load_failure_policy is 'fail', so a block evicted or a "
                    "sidecar down between lookup and load fails the request; set it to "
                    "'recompute' in --kv-transfer-config"
                )
            geometry = geometry_of(kv_cache_config, vllm_config)
            is_worker = role != KVConnectorRole.SCHEDULER
            parallel = parallel_of(vllm_config, kv_cache_config, is_worker)
            self._scheduler: SchedulerSide | None = None
            self._worker: WorkerSide | None = None
            if not is_worker:
                hashes = uses_block_hashes(settings, vllm_config, geometry.block_size)
                self._scheduler = SchedulerSide(
                    settings,
                    geometry,
                    use_block_hashes=hashes,
                    block_table=self._block_table,
                    parallel=parallel,
                )
            else:
                self._worker = WorkerSide(settings, geometry, parallel)

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
            """The per-layer hooks must run (not be skipped by a full CUDA
            graph's replay) where they copy: layer-wise, or synchronous loads."""
            extra = extra_config or {}
            layer_wise = extra.get("layer_wise", LAYER_WISE_DEFAULT)
            return layer_wise is True or extra.get("load_async", True) is False

        @property
        def requires_kv_delivery(self) -> bool:
            return False  # a cache: a dropped save is a later miss

        # ---- scheduler side --------------------------------------------------------

        def get_num_new_matched_tokens(
            self, request: Any, num_computed_tokens: int
        ) -> tuple[int | None, bool]:
            assert self._scheduler is not None
            return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> None:
            assert self._scheduler is not None
            block_ids = blocks.get_block_ids()[0]
            self._scheduler.after_alloc(request, list(block_ids), num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            assert self._scheduler is not None
            return self._scheduler.build_meta(scheduler_output)

        def update_connector_output(self, connector_output: Any) -> None:
            assert self._scheduler is not None
            self._scheduler.load_failed(set(connector_output.invalid_block_ids or ()))

        def request_finished(
            self, request: Any, block_ids: list[int]
        ) -> tuple[bool, dict[str, Any] | None]:
            assert self._scheduler is not None
            return self._scheduler.finished(request), None

        def _block_table(self, req_id: str) -> list[int]:
            """The request's engine blocks, from vLLM's cache manager (bound
            by the scheduler after this connector is made)."""
            manager = self._kv_cache_manager
            assert manager is not None, "vLLM binds its KV cache manager before scheduling"
            return list(manager.get_block_ids(req_id)[0])

        # ---- worker side ------------------------------------------------------------

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            assert self._worker is not None
            self._worker.register(kv_caches)

        def handle_preemptions(self, kv_connector_metadata: Any) -> None:
            assert self._worker is not None
            self._worker.handle_preemptions(kv_connector_metadata)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            assert self._worker is not None
            self._worker.start_loads(self._get_connector_metadata())

        def wait_for_layer_load(self, layer_name: str) -> None:
            assert self._worker is not None
            self._worker.wait_for_layer(layer_name)

        def save_kv_layer(
            self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
        ) -> None:
            """`layer_wise`: queue this layer's copy of the step's saves; else
            nothing (the step's blocks are copied once `wait_for_save` queues them)."""
            assert self._worker is not None
            self._worker.save_layer(self._get_connector_metadata(), layer_name)

        def wait_for_save(self) -> None:
            assert self._worker is not None
            self._worker.run_saves(self._get_connector_metadata())

        def get_finished(
            self, finished_req_ids: set[str]
        ) -> tuple[set[str] | None, set[str] | None]:
            assert self._worker is not None
            sending, recving = self._worker.finished()
            return sending or None, recving or None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return set() if self._worker is None else self._worker.load_errors()

        def shutdown(self) -> None:
            for side in (self._scheduler, self._worker):
                if side is not None:
                    side.close()

    return KVSidecarConnector
