"""`WorkerSide`: the connector's half in a vLLM worker (one per TP rank). It
runs the loads and saves the scheduler side planned, on this rank's KV.

Every sidecar call and copy runs on one thread of its own (the only user of
the rank's client), in the order the steps queued them, so the step never
waits for a save: `wait_for_save` queues the step's saves and returns. With
CUDA KV the thread queues each copy on its own stream after an event
recorded on the caller's stream (at `wait_for_save` for saves, so a save
reads the blocks only once the forward has written them; at `start_load_kv`
for loads, so a load lands after the work queued before it). vLLM keeps a finished
request's blocks until `finished()` reports its saves done (delayed free);
a preempted request's saves are waited for before the next forward
(`handle_preemptions`). Asynchronous loads run on the same thread: a
request waiting for them does not hold up the step.

Layer-wise (`layer_wise`): the same thread copies a save's layers as the
forward computes them and a synchronous load's ahead of the forward, split
by split (engine_shim.kvconnector.layered).

TP: rank 0 asks the sidecar for each plan and relays it to the other ranks
(`RankRelay`), which run it on their shard; see `Parallel`.

Failure policy: a load that fails or comes back short never fails the step.
Its missing blocks are reported by `load_errors()` (and the request as
finished receiving), so vLLM recomputes them; vLLM takes the union of every
rank's errors, so a block one rank failed is recomputed on all. A failed
save is a future miss, logged; its request is reported finished sending all
the same, so vLLM frees the blocks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine_shim.channel import SidecarError, SidecarUnavailable
from engine_shim.client import KVClient
from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.layered import (
    LayerJob,
    StepSaves,
    copy_layers,
    finish_layered,
    load_stop,
)
from engine_shim.kvconnector.metadata import ConnectorMeta, LoadSpec, SaveSpec
from engine_shim.kvconnector.parallel import Parallel
from engine_shim.kvconnector.relay import RankRelay, Tag, lead, plan_and_tokens, plan_of
from engine_shim.kvconnector.settings import ConnectorSettings
from engine_shim.transfer import LayeredTransfer, TransferHandle

log = logging.getLogger(__name__)

TRANSFER_ERRORS = (SidecarUnavailable, SidecarError, TimeoutError)
"""What a transfer raises when the cache (or the TP leader), not the engine, is at fault."""

RELAY_WAIT = 10
"""A follower waits this many client timeouts for its leader's plan."""


@dataclass
class _Load:
    spec: LoadSpec
    future: Future[tuple[TransferHandle | None, int]]
    """(the handle while its copies may still run, blocks in the cache)."""


class WorkerSide:
    def __init__(
        self, settings: ConnectorSettings, geometry: KVGeometry, parallel: Parallel | None = None
    ) -> None:
        self.settings, self.geometry = settings, geometry
        self.parallel = parallel or Parallel()
        self.block_size = geometry.block_size
        self._client: KVClient | None = None
        self._relay: RankRelay | None = None
        self._stream: Any = None
        """The thread's CUDA stream (KV on a GPU), else None."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvsidecar-transfer")
        self._layer_index: dict[str, int] = {}
        self._sync_loads: list[tuple[LoadSpec, TransferHandle | None]] = []
        self._async_loads: list[_Load] = []
        self._finals: list[Future[str]] = []
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._saving: StepSaves | None = None
        """Layer-wise: the step's saves, once its first layer is computed."""
        self._layered_loads: list[LayerJob] = []
        self._load_points: dict[int, Future[None]] = {}
        """Layer-wise: per split, the task that copies this step's loads up to it."""

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register vLLM's `{layer name: [B, H, N, C] view}` (model order) with
        the sidecar. ValueError if they are not the expected geometry,
        SidecarError if the sidecar refuses them (say, it serves another
        layout); a sidecar that is down only logs: loads miss until it is up."""
        planes = self.geometry.planes(kv_caches)
        client = KVClient.connect(self.settings.endpoint, timeout=self.settings.timeout)
        base = self.settings.engine_id
        try:
            args = {**self.geometry.register_args(self.settings), **self.parallel.register_args()}
            client.register(planes, engine_id=self.parallel.engine_id(base), **args)
        except SidecarUnavailable as err:  # loads re-register once it is up
            log.warning("kvsidecar: no sidecar yet (%s); every load misses until one is", err)
        except Exception:
            client.close()
            raise
        self._pool.submit(lambda: None).result()  # the previous registration's work is done
        if self._client is not None:
            self._client.close()
        self._client = client
        if self._relay is None and self.parallel.relayed:
            self._relay = RankRelay(base, self.parallel.tp_rank, self.parallel.tp_size)
        if planes[0].is_cuda:
            self._stream = torch.cuda.Stream(planes[0].device)  # type: ignore[no-untyped-call]
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    # ---- the step ------------------------------------------------------------------

    def start_loads(self, meta: ConnectorMeta) -> None:
        """Queue this step's loads. Synchronous ones (`load_async` false) are
        planned and queued before this returns, so `wait_for_layer` can wait
        for them; a short hit is reported as load errors now."""
        self._require_client()
        ready = self._stream_point() if meta.loads else None
        if meta.loads and self.settings.layer_wise and not self.settings.load_async:
            self._start_layered_loads(meta, ready)
            return
        for spec in meta.loads:
            queue_only = not self.settings.load_async
            future = self._pool.submit(self._load, meta.step, spec, queue_only, ready)
            if self.settings.load_async:
                self._async_loads.append(_Load(spec, future))
                continue
            handle, in_cache = future.result()
            # vLLM reads the errors of a synchronous load in this step's pass,
            # before wait_for_save when it defers that past a draft model's forward.
            self._fail(spec, in_cache)
            self._sync_loads.append((spec, handle))

    def wait_for_layer(self, layer_name: str) -> None:
        """Make the current CUDA stream wait for the synchronous loads of this
        layer (a no-op for CPU tensors, whose copies have landed, and for
        asynchronous loads, reported by `finished` once landed). Layer-wise:
        first wait for the thread to have copied this layer."""
        if not self._sync_loads and not self._load_points:
            return
        index = self._layer(layer_name)
        if self._load_points:
            self._load_points[load_stop(self.geometry.layer_splits, index + 1)].result()
            for job in self._layered_loads:
                if job.transfer is not None:
                    job.transfer.wait_layer(index)
        for _, handle in self._sync_loads:
            if handle is not None:
                handle.wait_layer(index)

    def save_layer(self, meta: ConnectorMeta, layer_name: str) -> None:
        """Layer-wise: the forward has computed `layer_name`; queue its copy
        for this step's saves (the step's first layer plans them). A no-op
        with `layer_wise` off."""
        if not (self.settings.layer_wise and self.parallel.saves and meta.saves):
            return
        layer = self._layer(layer_name)
        saving = self._saving
        if saving is None or saving.step != meta.step:
            saving = self._saving = StepSaves(meta.step, [LayerJob(spec) for spec in meta.saves])
            for job in saving.jobs:
                self._pool.submit(self._plan_layered_save, meta.step, job)
        if saving.computed_layer(layer):
            ready = self._stream_point()  # the forward wrote the layers
            self._pool.submit(self._copy_layers, saving.jobs, saving.prefix, ready, True)

    def handle_preemptions(self, meta: ConnectorMeta) -> None:
        """Before a forward that may overwrite a preempted request's blocks:
        let every save queued so far land."""
        if meta.preempted:
            self._pool.submit(lambda: None).result()

    def run_saves(self, meta: ConnectorMeta) -> None:
        """After the step's forward: queue its saves and return. Requests in
        `meta.finished` are reported by `finished()` once all their saves
        queued so far are done."""
        self._end_sync_loads()
        ready = self._stream_point() if meta.saves else None  # the forward wrote the blocks
        if self._saving is not None and self._saving.step == meta.step:
            for job in self._saving.jobs:  # layer-wise: the layers left, then the report
                self._pool.submit(self._finish_layered, job, ready)
        elif self.parallel.saves:
            for spec in meta.saves:
                self._pool.submit(self._save, meta.step, spec, ready)
        self._saving = None
        for req_id in meta.finished:
            self._finals.append(self._pool.submit(str, req_id))  # req_id, after the jobs before

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose saves are done, requests whose asynchronous load is
        done or failed) since the last call."""
        sending = {f.result() for f in self._finals if f.done()}
        self._finals = [f for f in self._finals if not f.done()]
        pending = []
        for load in self._async_loads:
            if not load.future.done():
                pending.append(load)
                continue
            _, in_cache = load.future.result()
            self._fail(load.spec, in_cache)
            self._recving.add(load.spec.req_id)
        self._async_loads = pending
        recving, self._recving = self._recving, set()
        return sending, recving

    def load_errors(self) -> set[int]:
        """Engine block ids that failed to load since the last call."""
        self._end_layered_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def drain(self) -> None:
        """Block until every transfer queued so far has run (a benchmark
        between engines sharing a host; never needed by vLLM)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        """Let the queued work end, then unregister."""
        self._pool.shutdown(wait=True)
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---- on the transfer thread ------------------------------------------------------

    def _load(self, step: int, spec: LoadSpec, queue_only: bool, ready: Any) -> tuple[Any, int]:
        """(handle, blocks in the cache once it lands): copies queued (after
        `ready`: work queued before on the forward's stream may still use the
        blocks), and with `queue_only` false, landed and reported. Never raises."""
        handle: TransferHandle | None = None
        try:
            with self._on_stream(ready):
                handle, in_cache = self._plan_load(step, spec)
                if handle is not None and not queue_only:
                    handle.wait()
            return handle, in_cache
        except Exception as err:
            unexpected = not isinstance(err, TRANSFER_ERRORS)  # a bug: its traceback too
            log.warning("kvsidecar: load of %s failed: %s", spec.req_id, err, exc_info=unexpected)
            return None, spec.skip_blocks

    def _plan_load(self, step: int, spec: LoadSpec) -> tuple[TransferHandle | None, int]:
        client = self._require_client()
        tag = (step, "load", spec.req_id)
        skip = spec.skip_blocks * self.block_size
        if self._relay is not None and not self.parallel.leader:
            got = self._leader_plan(tag)
            if got is None:  # the leader's load failed
                return None, spec.skip_blocks
            plan, num_tokens = got
            return (None if plan is None else client.execute(plan)), num_tokens // self.block_size
        handle = lead(
            self._relay,
            tag,
            lambda: client.load_keys(spec.keys, spec.block_ids, skip_tokens=skip),
            plan_and_tokens,
        )
        return handle, handle.num_tokens // self.block_size

    def _save(self, step: int, spec: SaveSpec, ready: Any) -> None:
        """Copy the blocks to the sidecar (a failure is a later miss). Never raises."""
        tag = (step, "save", spec.req_id)
        try:
            client = self._require_client()
            with self._on_stream(ready):
                if self._relay is not None and not self.parallel.leader:
                    plan = self._leader_plan(tag)
                    if plan is not None:
                        client.execute(plan).wait()
                    return
                save = lead(
                    self._relay, tag, lambda: client.save_keys(spec.keys, spec.block_ids), plan_of
                )
                save.wait()
        except Exception as err:
            log.warning("kvsidecar: save of %s failed, a later miss: %s", spec.req_id, err)

    # ---- layer-wise (engine_shim.kvconnector.layered) ----------------------------------

    def _start_layered_loads(self, meta: ConnectorMeta, ready: Any) -> None:
        """Plan the step's loads and copy them split by split, on the thread."""
        self._end_layered_loads()
        jobs = self._layered_loads = [LayerJob(spec) for spec in meta.loads]
        for job in jobs:
            self._pool.submit(self._plan_layered_load, meta.step, job)
        self._load_points = {
            end: self._pool.submit(self._copy_layers, jobs, end, ready, False)
            for end in self.geometry.layer_splits
        }

    def _end_layered_loads(self) -> None:
        """Report this step's layered loads: what did not land is a load error."""
        jobs, self._layered_loads, self._load_points = self._layered_loads, [], {}
        for job in jobs:
            assert isinstance(job.spec, LoadSpec)
            self._fail(job.spec, self._pool.submit(self._finish_layered, job).result())

    def _plan_layered_load(self, step: int, job: LayerJob) -> None:
        """As `_plan_load`, the copies left to `_copy_layers`. Never raises."""
        spec = job.spec
        assert isinstance(spec, LoadSpec)
        job.in_cache = spec.skip_blocks
        tag = (step, "load", spec.req_id)
        try:
            client = self._require_client()
            if self._relay is not None and not self.parallel.leader:
                got = self._leader_plan(tag)
                if got is not None:  # else the leader's load failed
                    plan, num_tokens = got
                    job.transfer = None if plan is None else client.execute_layered(plan)
                    job.in_cache = num_tokens // self.block_size
                return
            skip = spec.skip_blocks * self.block_size
            transfer = lead(
                self._relay,
                tag,
                lambda: client.layered_load_keys(spec.keys, spec.block_ids, skip_tokens=skip),
                plan_and_tokens,
            )
            job.transfer, job.in_cache = transfer, transfer.num_tokens // self.block_size
        except Exception as err:
            log.warning("kvsidecar: load of %s failed: %s", spec.req_id, err)

    def _plan_layered_save(self, step: int, job: LayerJob) -> None:
        """As `_save`, the copies left to `_copy_layers`. Never raises."""
        spec = job.spec
        tag = (step, "save", spec.req_id)
        try:
            client = self._require_client()
            if self._relay is not None and not self.parallel.leader:
                plan = self._leader_plan(tag)
                job.transfer = None if plan is None else client.execute_layered(plan)
                return

            def ask() -> LayeredTransfer:
                # Kept before the plan is relayed: a relay that fails then
                # leaves this rank's copies to finish and be reported.
                job.transfer = client.layered_save_keys(spec.keys, spec.block_ids)
                return job.transfer

            lead(self._relay, tag, ask, plan_of)
        except Exception as err:
            log.warning("kvsidecar: save of %s failed, a later miss: %s", spec.req_id, err)

    def _copy_layers(self, jobs: list[LayerJob], layers: int, ready: Any, save: bool) -> None:
        copy_layers(jobs, layers, save, self._on_stream(ready))

    def _finish_layered(self, job: LayerJob, ready: Any = None) -> int:
        return finish_layered(job, self._on_stream(ready))

    def _stream_point(self) -> Any:
        """CUDA KV: an event where the caller's current stream stands now; else None."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _leader_plan(self, tag: Tag) -> Any:
        """Follower: what the leader sent under `tag`; TimeoutError after
        RELAY_WAIT client timeouts. A plan that comes after its follower gave
        up is cancelled (its slots go back), never run: the blocks it names
        may be another request's by then."""
        assert self._relay is not None
        client = self._require_client()
        return self._relay.follow(tag, RELAY_WAIT * self.settings.timeout, client.cancel)

    @contextlib.contextmanager
    def _on_stream(self, ready: Any) -> Iterator[None]:
        """CUDA KV: run the copies queued inside on the thread's stream, after `ready`."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            yield

    # ---- helpers ------------------------------------------------------------------------

    def _layer(self, layer_name: str) -> int:
        index = self._layer_index.get(layer_name)
        if index is None:
            raise ValueError(f"unknown KV layer {layer_name!r}")
        return index

    def _end_sync_loads(self) -> None:
        """Wait for this step's synchronous loads to be reported (their copies
        landed before the forward read them); a failure is a load error."""
        self._end_layered_loads()
        loads, self._sync_loads = self._sync_loads, []
        for spec, handle in loads:
            if handle is None:
                continue
            try:
                self._pool.submit(handle.wait).result()
            except Exception as err:
                log.warning("kvsidecar: load of %s failed: %s", spec.req_id, err)
                self._fail(spec, spec.skip_blocks)

    def _fail(self, spec: LoadSpec, in_cache: int) -> None:
        """Blocks `in_cache..` of the load did not land: vLLM recomputes them."""
        self._load_errors.update(int(b) for b in spec.block_ids[in_cache:])

    def _require_client(self) -> KVClient:
        if self._client is None:
            raise RuntimeError("register_kv_caches() must come before loads and saves")
        return self._client
