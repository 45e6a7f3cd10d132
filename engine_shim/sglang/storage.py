"""`KVSidecarStorage`: kvsidecar as SGLang's HiCache L3 storage backend.

SGLang (0.5.23) loads it through its dynamic backend:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvsidecar",
        "module_path": "engine_shim.sglang_storage", "class_name": "KVSidecarStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "model_revision": "..."}'

Contract with SGLang's cache controller:
- Built as `cls(storage_config, kwargs)`; the extra config is checked here
  (settings.py: a ConfigError naming the key). The host pool comes later,
  through `register_mem_pool_host`: its pages are registered with the
  sidecar as the engine's blocks (geometry.py), so a page moves between the
  host pool and a shm slot in one copy, by the sidecar's copier.
- Keys: one SHA-256 hex chain hash per page, with the pages before the
  call's in `extra_info.prefix_keys` (keys.py).
- `batch_exists` / `batch_exists_v2`: the call's leading pages the sidecar
  holds (longest prefix), in any tier. SGLang MIN-reduces it across TP
  ranks, so a page one rank lacks is a miss for all.
- `batch_get_v1` / `batch_set_v1` (and the v2 forms for the KV pool): one
  bool per page, True for a leading run; a get loads the leading pages it
  finds, a set stores past what the sidecar has (only while it holds the
  prefix) and reports what is cached once it returns.
- Failure: nothing raises into SGLang's threads. A sidecar that is down or
  slow answers misses within `timeout` and sets come back failed; the
  clients re-register by themselves when it is back.
- Pools other than KV (Mamba, SWA, indexer pools of hybrid models) are not
  stored: their pages miss, so a hybrid model's prefix never restores half.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

from contract import protocol as p
from contract.endpoint import default_endpoint
from engine_shim.channel import Channel, SidecarUnavailable
from engine_shim.client import KVClient
from engine_shim.sglang.clients import CallRecord, ThreadClients
from engine_shim.sglang.geometry import HostGeometry, RankShard
from engine_shim.sglang.keys import PageChain, PrefixMissing
from engine_shim.sglang.settings import ConfigError, StorageSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

WARN_EVERY = 60.0
"""Seconds between two warnings of one kind (a sidecar that stays down)."""


class KVSidecarStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        """ConfigError (a ValueError naming the key) for a bad extra config
        or a parallel setup this backend does not serve. `kwargs`: the
        factory's extra arguments (none for SGLang's dynamic backend)."""
        self.settings = StorageSettings.from_extra_config(
            storage_config.extra_config, model_name=storage_config.model_name
        )
        self.shard = _shard_of(storage_config)
        self.geometry: HostGeometry | None = None
        """The host pool's pages, once SGLang registers it."""
        self._clients: ThreadClients | None = None
        self._record = CallRecord(page_bytes=0)
        self._warned: dict[str, float] = {}

    # ---- set-up ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool and register its pages with the sidecar
        (now, or when it comes up). ValueError for a pool it cannot serve."""
        # Exactly these: a subclass may keep part of a page outside
        # kv_buffer (MHATokenToKVPoolMXFP8Host's scales), which would be lost.
        if type(mem_pool_host) not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
            raise ValueError(
                "kvsidecar stores MHATokenToKVPoolHost and MLATokenToKVPoolHost pools, "
                f"not {type(mem_pool_host).__name__}"
            )
        is_mla = isinstance(mem_pool_host, MLATokenToKVPoolHost)
        if is_mla != self.shard.is_mla:
            kind = "an MLA" if is_mla else "an MHA"
            raise ValueError(
                f"{kind} host pool, but the storage config says is_mla_model={self.shard.is_mla}"
            )
        geometry = HostGeometry.of(
            mem_pool_host.kv_buffer, mem_pool_host.layout, mem_pool_host.page_size, is_mla=is_mla
        )
        if self._clients is not None:
            self._clients.close()
        super().register_mem_pool_host(mem_pool_host)
        self.geometry = geometry
        self._record = CallRecord(page_bytes=geometry.page_bytes)
        self._clients = ThreadClients(lambda: self._new_client(geometry))
        self._clients.get()  # registers now (or once the sidecar answers)

    def _new_client(self, geometry: HostGeometry) -> KVClient:
        s = self.settings
        client = KVClient.connect(s.endpoint, timeout=s.timeout)
        try:
            client.register(
                list(geometry.planes),
                model_name=s.model_name,
                model_revision=s.model_revision,
                tokens_per_block=geometry.page_size,
                num_kv_heads=geometry.num_heads,
                head_dim=geometry.head_dim,
                layout="block_major",
                layout_detail=self.shard.detail(geometry.layout),
                tenant=s.tenant,
            )
        except SidecarUnavailable as err:  # registered when it answers
            self._warn("down", f"kvsidecar: no sidecar yet ({err}); pages miss until one answers")
        except BaseException:
            client.close()
            raise
        return client

    def close(self) -> None:
        """Unregister and unmap (SGLang's detach calls it). Idempotent."""
        if self._clients is not None:
            self._clients.close()

    # ---- the zero-copy calls ------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The call's leading pages the sidecar holds, in any tier; 0 when down."""
        return self._guard("exists", 0, lambda: self._exists(keys, extra_info))

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load the leading pages the sidecar holds into the host pool at
        `host_indices` (page i at host_indices[i * page_size])."""
        return self._guard(
            "get", [False] * len(keys), lambda: self._move("get", keys, host_indices, extra_info)
        )

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at `host_indices` under `keys`."""
        return self._guard(
            "set", [False] * len(keys), lambda: self._move("set", keys, host_indices, extra_info)
        )

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        kv = self.batch_exists(keys, extra_info)
        hits = {PoolName.KV: kv} if kv else {}
        if pool_transfers:  # pools this backend does not store: no prefix restores whole
            self._warn("pools", f"kvsidecar stores only the KV pool, not {_names(pool_transfers)}")
            return PoolTransferResult(0, hits, [])
        return PoolTransferResult(kv, hits, list(range(1, kv + 1)))

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, extra_info, self.batch_get_v1)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, extra_info, self.batch_set_v1)

    def _v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None,
        move: Callable[..., list[bool]],
    ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if transfer.name != PoolName.KV or transfer.host_indices is None:
                self._warn("pools", f"kvsidecar stores only the KV pool, not {transfer.name}")
                results[transfer.name] = [False] * len(keys)
            else:
                results[transfer.name] = move(keys, transfer.host_indices, extra_info)
        return results

    def _exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None) -> int:
        if not keys:
            return 0
        client, geometry = self._ready()
        chain = PageChain.of(keys, _prefix(extra_info, reading=True), client.digest_keys)
        return chain.hits(client.lookup_keys(chain.keys), geometry.page_size)

    def _move(
        self,
        kind: str,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> list[bool]:
        if not keys:
            return []
        client, geometry = self._ready()
        pages = _host_pages(host_indices, len(keys), geometry)
        chain = PageChain.of(keys, _prefix(extra_info, reading=kind == "get"), client.digest_keys)
        ps = geometry.page_size
        start = time.perf_counter()
        transfer = client.load_keys if kind == "get" else client.save_keys
        handle = transfer(chain.keys, chain.block_ids(pages), skip_tokens=chain.skip * ps)
        done = chain.hits(handle.wait(), ps)
        self._record.add(kind, done, time.perf_counter() - start)
        return [i < done for i in range(len(keys))]

    def _ready(self) -> tuple[KVClient, HostGeometry]:
        if self._clients is None or self.geometry is None:
            raise RuntimeError("no host pool registered yet")
        return self._clients.get(), self.geometry

    def _guard(self, what: str, default: T, call: Callable[[], T]) -> T:
        """`call()`, or `default` (a miss, a failed set) for any error: the
        cache is an optimisation, and SGLang's threads must not die of it."""
        try:
            return call()
        except SidecarUnavailable as err:
            self._warn("down", f"kvsidecar: sidecar unavailable ({err}); {what} misses")
        except PrefixMissing as err:
            self._warn("prefix", f"kvsidecar: {err}")
        except Exception as err:  # a refused call, a bad index: a miss, logged
            self._warn(f"error:{what}", f"kvsidecar: {what} failed: {err!r}")
        return default

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY) >= WARN_EVERY:
            self._warned[kind] = now
            log.warning(message)

    # ---- the rest of SGLang's interface ------------------------------------------------

    def clear(self) -> bool:
        """Drop every block of this model, revision and tenant from every
        tier (the sidecar's admin Clear, which needs its admin token: run
        SGLang as the sidecar's user, or set admin_token_file). False, and
        logged, when it cannot."""
        try:
            token = self._admin_token_path().read_text(encoding="ascii").strip()
            channel = Channel(self.settings.endpoint or default_endpoint(), 30.0)
            try:
                request = p.Clear(
                    v=p.PROTOCOL_VERSION,
                    id=0,
                    token=token,
                    model=self.settings.model_name,
                    revision=self.settings.model_revision,
                    tenant=self.settings.tenant or "",
                )
                reply, _ = channel.call(request)
            finally:
                channel.close()
        except Exception as err:
            log.error("kvsidecar: clear failed: %r", err)
            return False
        log.info("kvsidecar: cleared %s (kept, in use: %s)", reply.removed, reply.kept)
        return True

    def _admin_token_path(self) -> Path:
        if self.settings.admin_token_file is not None:
            return Path(self.settings.admin_token_file)
        endpoint = self.settings.endpoint or default_endpoint()
        if not endpoint.startswith("ipc://") or not endpoint.endswith(".sock"):
            raise ConfigError(f"admin_token_file is needed to clear the sidecar at {endpoint}")
        return Path(endpoint.removeprefix("ipc://").removesuffix(".sock") + ".admin")

    def get_stats(self) -> StorageMetrics:
        """Pages and GB/s of every get (prefetch) and set (backup) since the last call."""
        get_pages, get_gbps, set_pages, set_gbps = self._record.drain()
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(get_pages)
        metrics.prefetch_bandwidth.extend(get_gbps)
        metrics.backup_pgs.extend(set_pages)
        metrics.backup_bandwidth.extend(set_gbps)
        return metrics

    # The legacy calls copy every page through a temporary tensor; SGLang
    # uses them only without interface_v1, which the settings require.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        self._warn("legacy", "kvsidecar serves the zero-copy calls only: set interface_v1: 1")
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        self.get("")
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        self.get("")
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        self.get("")
        return False

    def exists(self, key: str) -> bool:
        """A page alone, without its prefix, cannot be looked up: use batch_exists."""
        self.get("")
        return False


def _shard_of(config: HiCacheStorageConfig) -> RankShard:
    if config.dcp_size > 1 or config.attn_cp_size > 1:
        raise ConfigError("kvsidecar does not store context-parallel (attn_cp / dcp) shards")
    if config.should_split_heads:
        raise ConfigError("kvsidecar does not store split-head pages (page_head with TP lcm)")
    return RankShard(
        is_mla=bool(config.is_mla_model),
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
    )


def _prefix(extra_info: HiCacheStorageExtraInfo | None, *, reading: bool) -> list[str] | None:
    """The call's `prefix_keys`. A read without them starts at the first
    page: SGLang 0.5.23's prefetch (HybridCacheController, used for every
    model) passes None for an empty prefix. Keyed from the first page, a
    page past it only misses (SGLang's page hashes are chain hashes, so no
    other page's key equals it). A write without them is refused: SGLang was
    not told to pass them, and its backups from the first page pass []."""
    prefix = None if extra_info is None else extra_info.prefix_keys
    return [] if prefix is None and reading else prefix


def _host_pages(host_indices: torch.Tensor, num_pages: int, geometry: HostGeometry) -> np.ndarray:
    """Host page ids of a call: page i starts at host_indices[i * page_size]."""
    ps = geometry.page_size
    if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != num_pages * ps:
        got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
        raise ValueError(f"{num_pages} pages need {num_pages * ps} host indices, got {got}")
    starts = host_indices.reshape(-1)[::ps].cpu().numpy().astype(np.int64)
    if (starts % ps).any() or starts.min() < 0 or starts.max() // ps >= geometry.num_pages:
        raise ValueError("host indices do not start whole pages of the host pool")
    return starts // ps


def _names(transfers: list[PoolTransfer]) -> list[str]:
    return [str(t.name) for t in transfers]
