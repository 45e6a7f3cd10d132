"""`SchedulerSide`: the connector's half in vLLM's scheduler. It decides
what each request loads and saves; the workers move the bytes.

The requests it reads are vLLM `Request`s, of which it uses `request_id`,
`all_token_ids`, `num_computed_tokens`, `mm_features`, `lora_request`,
`cache_salt`, `prompt_embeds` and, when keying from vLLM's hashes,
`block_hashes` (one chained digest per full block).

Contract with vLLM's scheduler:
- `get_num_new_matched_tokens` never claims a request's last token: vLLM
  must compute at least one token to get logits.
- A hit found by a lookup may be evicted before the load runs; the worker
  then reports those blocks as load errors and vLLM recomputes them.
- `request_finished` returns True (keep the blocks) while a save of the
  request's new full blocks is pending; the workers report it finished.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from contract.ids import BlockKeys
from engine_shim.channel import SidecarUnavailable
from engine_shim.client import KVClient
from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.lookups import Lookups
from engine_shim.kvconnector.metadata import ConnectorMeta, LoadSpec, SaveSpec
from engine_shim.kvconnector.settings import ConnectorSettings

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A request whose lookup hit, between the lookup and its allocation."""

    num_computed: int
    """Locally computed tokens the hit was counted from."""
    keys: BlockKeys


class SchedulerSide:
    def __init__(
        self, settings: ConnectorSettings, geometry: KVGeometry, *, use_block_hashes: bool
    ) -> None:
        """`use_block_hashes`: key blocks from `request.block_hashes` rather
        than from the tokens (the glue decides; see vllm_connector)."""
        self.settings, self.geometry = settings, geometry
        self.block_size = geometry.block_size
        self.use_block_hashes = use_block_hashes
        self._client = KVClient.connect(settings.endpoint, timeout=settings.timeout)
        try:
            self._client.register(
                geometry.stand_in(),
                engine_id=f"{settings.engine_id}-scheduler-{os.getpid()}",
                **geometry.register_args(settings),
            )
        except SidecarUnavailable as err:  # lookups re-register once it is up
            log.warning("kvsidecar: no sidecar yet (%s); every lookup misses until one is", err)
        self._lookups = Lookups(self._client, background=settings.lookup_async)
        self._pending: dict[str, _Pending] = {}
        self._loaded_blocks: dict[str, int] = {}
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """(tokens to load past `num_computed`, whether asynchronously), or
        (None, False): ask again, a lookup is in flight."""
        if isinstance(num_computed, bool) or not isinstance(num_computed, int) or num_computed < 0:
            raise ValueError(f"num_computed_tokens must be an int >= 0, got {num_computed!r}")
        if not self._cacheable(request):
            return 0, False
        # At least the last token is computed by vLLM, for its logits.
        loadable = (len(request.all_token_ids) - 1) // self.block_size
        if loadable * self.block_size <= num_computed:
            return 0, False
        keys = self.request_keys(request, loadable)
        hit = self._lookups.poll(request.request_id, keys)
        if hit is None:
            return None, False
        hit = min(hit, len(keys) * self.block_size)
        if hit <= num_computed:
            self._lookups.forget(request.request_id)
            return 0, False
        self._pending[request.request_id] = _Pending(num_computed, keys[: hit // self.block_size])
        return hit - num_computed, self.settings.load_async

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated `block_ids` (the request's, from its first block on)
        and will have `num_external_tokens` loaded past the local hit."""
        req_id = request.request_id
        pending = self._pending.get(req_id)
        if num_external_tokens == 0 or pending is None:
            self._forget(req_id)
            return
        skip = pending.num_computed // self.block_size
        end = skip + num_external_tokens // self.block_size
        if num_external_tokens % self.block_size or end > len(pending.keys):
            raise ValueError(
                f"request {req_id}: {num_external_tokens} external tokens past "
                f"{pending.num_computed} is not the {len(pending.keys)}-block hit offered"
            )
        if len(block_ids) < end:
            raise ValueError(f"request {req_id}: {len(block_ids)} blocks for a {end}-block load")
        blocks = np.asarray(block_ids[:end], dtype=np.int64)
        self._forget(req_id)
        self._loads.append(LoadSpec(req_id, BlockKeys(pending.keys[:end]), blocks, skip))
        self._loaded_blocks[req_id] = end

    def build_meta(self) -> ConnectorMeta:
        """This step's loads and saves; each is handed out once."""
        meta = ConnectorMeta(tuple(self._loads), tuple(self._saves))
        self._loads, self._saves = [], []
        return meta

    def finished(self, request: Any, block_ids: list[int]) -> bool:
        """The request is done: save its computed full blocks that it did not
        load from us. True: keep `block_ids` until a worker reports the save."""
        req_id = request.request_id
        self._forget(req_id)
        loaded = self._loaded_blocks.pop(req_id, 0)
        if not self._cacheable(request):
            return False
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        n = min(computed // self.block_size, len(block_ids))
        if n <= loaded:
            return False
        keys = self.request_keys(request, n)
        if len(keys) <= loaded:
            return False
        blocks = np.asarray(block_ids[: len(keys)], dtype=np.int64)
        self._saves.append(SaveSpec(req_id, keys, blocks))
        return True

    def request_keys(self, request: Any, num_blocks: int) -> BlockKeys:
        """Keys of the request's first `num_blocks` full blocks (fewer if vLLM
        has not hashed that many yet)."""
        if self.use_block_hashes:
            return self._client.digest_keys(list(request.block_hashes[:num_blocks]))
        tokens = request.all_token_ids[: num_blocks * self.block_size]
        return self._client.block_keys(np.asarray(tokens, dtype=np.int64))

    def _forget(self, req_id: str) -> None:
        """Drop the request's lookup result and pending hit."""
        self._lookups.forget(req_id)
        self._pending.pop(req_id, None)

    def _cacheable(self, request: Any) -> bool:
        """Token keys know nothing of images, LoRA adapters, cache salts or
        prompt embeddings (whose positions vLLM holds as token id 0):
        requests with them are cached only when keyed from vLLM's block
        hashes, which include them."""
        if self.use_block_hashes:
            return True
        if getattr(request, "prompt_embeds", None) is not None:  # a tensor: no truth value
            return False
        extras = ("mm_features", "lora_request", "cache_salt")
        return not any(getattr(request, name, None) for name in extras)

    def close(self) -> None:
        self._lookups.close()
        self._client.close()
