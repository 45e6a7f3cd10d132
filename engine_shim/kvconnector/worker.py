"""`WorkerSide`: the connector's half in a vLLM worker. It runs the loads
and saves the scheduler side planned, on this rank's KV tensors.

Failure policy: a load that fails or comes back short never fails the step.
Its missing blocks are reported by `load_errors()` (and the request as
finished receiving), so vLLM recomputes them. A failed save is a future miss,
logged; its request is reported finished sending all the same, so vLLM frees
the blocks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine_shim.channel import SidecarError, SidecarUnavailable
from engine_shim.client import KVClient
from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.metadata import ConnectorMeta, LoadSpec
from engine_shim.kvconnector.settings import ConnectorSettings
from engine_shim.transfer import TransferHandle

log = logging.getLogger(__name__)

TRANSFER_ERRORS = (SidecarUnavailable, SidecarError)
"""What a sidecar transfer raises when the cache, not the engine, is at fault."""


@dataclass
class _Load:
    spec: LoadSpec
    handle: TransferHandle
    reported_from: int
    """Blocks `reported_from..` are reported failed already."""


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, geometry: KVGeometry) -> None:
        self.settings, self.geometry = settings, geometry
        self.block_size = geometry.block_size
        self._client: KVClient | None = None
        self._layer_index: dict[str, int] = {}
        self._loads: list[_Load] = []
        self._recving: set[str] = set()
        self._sending: set[str] = set()
        self._load_errors: set[int] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register vLLM's `{layer name: [B, H, N, C] view}` (model order) with
        the sidecar. ValueError if they are not the expected geometry,
        SidecarError if the sidecar refuses them (say, it serves another
        layout); a sidecar that is down only logs: loads miss until it is up."""
        planes = self.geometry.planes(kv_caches)
        client = KVClient.connect(self.settings.endpoint, timeout=self.settings.timeout)
        try:
            args = self.geometry.register_args(self.settings)
            # One rank per engine (TP=1): a process of its own, even with data parallel.
            engine_id = f"{self.settings.engine_id}-worker-{os.getpid()}"
            client.register(planes, engine_id=engine_id, **args)
        except SidecarUnavailable as err:  # loads re-register once it is up
            log.warning("kvsidecar: no sidecar yet (%s); every load misses until one is", err)
        except Exception:
            client.close()
            raise
        if self._client is not None:
            self._client.close()
        self._client = client
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def start_loads(self, meta: ConnectorMeta) -> None:
        """Start this step's loads (CPU tensors: done on return)."""
        client = self._require_client()
        for spec in meta.loads:
            try:
                handle = client.load_keys(
                    spec.keys, spec.block_ids, skip_tokens=spec.skip_blocks * self.block_size
                )
            except TRANSFER_ERRORS as err:
                log.warning("kvsidecar: load of %s failed: %s", spec.req_id, err)
                self._fail(spec, spec.skip_blocks)
                continue
            load = _Load(spec, handle, spec.num_blocks)
            hit = handle.num_tokens // self.block_size
            if hit < spec.num_blocks and not self.settings.load_async:
                # A short hit is known now. vLLM reads the errors of a synchronous
                # load in this step's pass, before wait_for_save when it defers
                # that past a draft model's forward.
                self._fail(load, hit)
            self._loads.append(load)

    def wait_for_layer(self, layer_name: str) -> None:
        """Make the current CUDA stream wait for the synchronous loads of this
        layer (a no-op for CPU tensors and for asynchronous loads, which are
        waited for in `finished`)."""
        if self.settings.load_async or not self._loads:
            return
        index = self._layer_index.get(layer_name)
        if index is None:
            raise ValueError(f"unknown KV layer {layer_name!r}")
        for load in self._loads:
            load.handle.wait_layer(index)

    def run_saves(self, meta: ConnectorMeta) -> None:
        """Copy finished requests' blocks to the sidecar; they are reported
        by the next `finished`, when vLLM may free them."""
        if meta.saves:
            client = self._require_client()
        for spec in meta.saves:
            try:
                client.save_keys(spec.keys, spec.block_ids).wait()
            except TRANSFER_ERRORS as err:
                log.warning("kvsidecar: save of %s failed, a later miss: %s", spec.req_id, err)
            self._sending.add(spec.req_id)
        if not self.settings.load_async:
            self._finish_loads()

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose save is done, requests whose asynchronous load is
        done or failed) since the last call."""
        if self.settings.load_async:
            self._finish_loads()
        sending, self._sending = self._sending, set()
        recving, self._recving = self._recving, set()
        return sending, recving

    def load_errors(self) -> set[int]:
        """Engine block ids that failed to load since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _finish_loads(self) -> None:
        loads, self._loads = self._loads, []
        for load in loads:
            try:
                loaded = load.handle.wait() // self.block_size
            except TRANSFER_ERRORS as err:
                log.warning("kvsidecar: load of %s failed: %s", load.spec.req_id, err)
                loaded = load.spec.skip_blocks
            if loaded < load.spec.num_blocks:
                self._fail(load, loaded)
            elif self.settings.load_async:
                self._recving.add(load.spec.req_id)

    def _fail(self, load: LoadSpec | _Load, loaded_blocks: int) -> None:
        """Blocks `loaded_blocks..` of the load did not land: vLLM recomputes
        them. Each block is reported once."""
        if isinstance(load, _Load):
            spec, end = load.spec, load.reported_from
            load.reported_from = min(end, loaded_blocks)
        else:
            spec, end = load, load.num_blocks
        self._load_errors.update(int(b) for b in spec.block_ids[loaded_blocks:end])
        if self.settings.load_async:
            self._recving.add(spec.req_id)

    def _require_client(self) -> KVClient:
        if self._client is None:
            raise RuntimeError("register_kv_caches() must come before loads and saves")
        return self._client
