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
- Every full block is offered for saving in the step whose forward
  completes it (`build_meta`), once; the sidecar makes it visible only when
  every TP rank's copy has landed, so a block of a request preempted or
  aborted before its save landed is never seen.
- `request_finished` returns True (keep the blocks) when any save was
  offered for the request; the workers report it finished sending once
  those saves are done. A preempted request's blocks are freed at once:
  the workers wait for its saves before the next forward (handle_preemptions).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from contract.ids import BlockKeys, key_at
from engine_shim.channel import SidecarUnavailable
from engine_shim.client import KVClient
from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.lookups import Lookups
from engine_shim.kvconnector.metadata import ConnectorMeta, LoadSpec, SaveSpec
from engine_shim.kvconnector.parallel import Parallel
from engine_shim.kvconnector.settings import ConnectorSettings

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A request whose lookup hit, between the lookup and its allocation."""

    num_computed: int
    """Locally computed tokens the hit was counted from."""
    keys: BlockKeys


@dataclass
class _Running:
    """A request vLLM allocated blocks for."""

    request: Any
    offered: int
    """Leading full blocks offered for saving, or loaded from the sidecar."""
    saving: bool = False
    """A save was offered: its blocks must outlive it (delayed free)."""
    keys: BlockKeys | None = None
    """Its leading blocks' keys so far: each step hashes only its new blocks."""


BlockTable = Callable[[str], Sequence[int]]
"""The engine block ids a request holds now, from its first block on."""


class SchedulerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        geometry: KVGeometry,
        *,
        use_block_hashes: bool,
        block_table: BlockTable,
        parallel: Parallel | None = None,
    ) -> None:
        """`use_block_hashes`: key blocks from `request.block_hashes` rather
        than from the tokens (the glue decides; see vllm_connector).
        `block_table(req_id)`: the request's engine blocks (vLLM's cache
        manager knows them)."""
        self.settings, self.geometry = settings, geometry
        self.block_size = geometry.block_size
        self.use_block_hashes = use_block_hashes
        self._block_table = block_table
        self._client = KVClient.connect(settings.endpoint, timeout=settings.timeout)
        try:
            self._client.register(
                geometry.stand_in(),
                engine_id=f"{settings.engine_id}-scheduler-{os.getpid()}",
                tp_size=(parallel or Parallel()).shards,  # the workers' namespace
                **geometry.register_args(settings),
            )
        except SidecarUnavailable as err:  # lookups re-register once it is up
            log.warning("kvsidecar: no sidecar yet (%s); every lookup misses until one is", err)
        self._lookups = Lookups(self._client, background=settings.lookup_async)
        self._pending: dict[str, _Pending] = {}
        self._prompt_keys: dict[str, BlockKeys] = {}
        """Keys hashed for a request's lookup, kept until it is allocated."""
        self._running: dict[str, _Running] = {}
        self._step = 0
        self._loads: list[LoadSpec] = []
        self._finished: list[str] = []

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
        keys = self._prompt_keys.get(request.request_id)
        if keys is None or len(keys) < loadable:
            running = self._running.get(request.request_id)  # a preempted one, resuming
            known = keys if keys is not None else (running.keys if running else None)
            keys = self.request_keys(request, loadable, known)
            self._prompt_keys[request.request_id] = keys
        hit = self._lookups.poll(request.request_id, keys)
        if hit is None:
            return None, False
        hit = min(hit, len(keys) * self.block_size)
        if hit <= num_computed:
            self._lookups.forget(request.request_id)
            return 0, False
        hit_keys = BlockKeys(keys[: hit // self.block_size])
        self._pending[request.request_id] = _Pending(num_computed, hit_keys)
        return hit - num_computed, self.settings.load_async

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated `block_ids` (the request's, from its first block on)
        and will have `num_external_tokens` loaded past the local hit."""
        req_id = request.request_id
        pending = self._pending.get(req_id)
        keys = self._prompt_keys.get(req_id)
        if num_external_tokens == 0 or pending is None:
            self._forget(req_id)
            self._track(request, 0, keys)
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
        self._track(request, end, keys)

    def build_meta(self, scheduler_output: Any) -> ConnectorMeta:
        """This step's loads, saves and finished requests; each is handed out
        once. Every full block the step's forward completes is offered now
        (chunked prefill and decode alike), so another request with the
        same prefix hits while this one still runs. `scheduler_output`:
        vLLM's, read before it advances the requests' computed tokens."""
        preempted = tuple(scheduler_output.preempted_req_ids or ())
        for req_id in preempted:
            running = self._running.get(req_id)
            if running is not None:  # its blocks are gone; re-tracked when it resumes
                # The saves it was offered need no delayed free any more: the
                # workers let them land before the blocks are used again
                # (handle_preemptions). Else a resumed request aborted while
                # it loads would be freed twice, once for the load.
                running.offered, running.saving = 0, False
        # A request loading synchronously runs in its load's step, whose
        # forward reads the blocks even where the load fell short: nothing
        # it computes then is offered, until vLLM has heard of the blocks
        # that failed (`load_failed`).
        loading = set() if self.settings.load_async else {spec.req_id for spec in self._loads}
        saves = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            running = self._running.get(req_id)
            if running is not None and n > 0 and req_id not in loading:
                spec = self._fill_save(running, running.request.num_computed_tokens + n)
                if spec is not None:
                    saves.append(spec)
        self._step += 1
        meta = ConnectorMeta(
            self._step, tuple(self._loads), tuple(saves), tuple(self._finished), preempted
        )
        self._loads, self._finished = [], []
        return meta

    def load_failed(self, invalid_blocks: set[int]) -> None:
        """Engine blocks whose load failed (every rank's, as vLLM reports
        them): vLLM recomputes each request from its first such block, and
        that block is offered again once computed (it may have been counted
        as loaded)."""
        if not invalid_blocks:
            return
        for req_id, running in self._running.items():
            if not running.offered:  # a preempted one holds no blocks
                continue
            table = self._block_table(req_id)[: running.offered]
            bad = next((i for i, block in enumerate(table) if block in invalid_blocks), None)
            if bad is not None:
                running.offered = bad

    def finished(self, request: Any) -> bool:
        """The request is done (finished, aborted or dropped). True: keep its
        blocks until the workers report every save offered for it done."""
        req_id = request.request_id
        self._forget(req_id)
        running = self._running.pop(req_id, None)
        if running is None or not running.saving:
            return False
        self._finished.append(req_id)
        return True

    def _track(self, request: Any, loaded_blocks: int, keys: BlockKeys | None) -> None:
        """A request was allocated blocks: first, or again after an
        asynchronous load or a preemption (which reset what it offered).
        `keys`: its leading blocks' keys, hashed for its lookup."""
        if self._cacheable(request):
            running = self._running.setdefault(request.request_id, _Running(request, 0))
            running.offered = max(running.offered, loaded_blocks)
            if keys is not None and (running.keys is None or len(keys) > len(running.keys)):
                running.keys = keys

    def _fill_save(self, running: _Running, computed_after: int) -> SaveSpec | None:
        """The save of the full blocks the step completes, if any."""
        request = running.request
        full = min(computed_after, len(request.all_token_ids)) // self.block_size
        if full <= running.offered:
            return None
        table = self._block_table(request.request_id)
        keys = running.keys = self.request_keys(request, min(full, len(table)), running.keys)
        if len(keys) <= running.offered:
            return None
        blocks = np.asarray(table[: len(keys)], dtype=np.int64)
        spec = SaveSpec(request.request_id, keys, blocks, len(keys) - running.offered)
        running.offered, running.saving = len(keys), True
        return spec

    def request_keys(
        self, request: Any, num_blocks: int, known: BlockKeys | None = None
    ) -> BlockKeys:
        """Keys of the request's first `num_blocks` full blocks (fewer if vLLM
        has not hashed that many yet); `known`: keys of its first blocks
        already computed, which the new ones extend."""
        done = 0 if known is None else min(len(known), num_blocks)
        if known is not None and done == num_blocks:
            return BlockKeys(known[:num_blocks])
        parent = None if not done else key_at(known, done - 1)  # type: ignore[arg-type]
        if self.use_block_hashes:
            digests = list(request.block_hashes[done:num_blocks])
            new = self._client.digest_keys(digests, parent)
        else:
            tokens = request.all_token_ids[done * self.block_size : num_blocks * self.block_size]
            new = self._client.block_keys(np.asarray(tokens, dtype=np.int64), parent)
        if not done:
            return new
        return BlockKeys(np.concatenate([known[:done], new]))  # type: ignore[index]

    def _forget(self, req_id: str) -> None:
        """Drop the request's lookup result, pending hit and lookup keys."""
        self._lookups.forget(req_id)
        self._pending.pop(req_id, None)
        self._prompt_keys.pop(req_id, None)

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
