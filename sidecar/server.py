"""The sidecar daemon: one control loop that owns every piece of cache state.

One thread, one ZeroMQ ROUTER socket. Each request is decoded, validated and
answered before the next is read, so the index, mempool and plans need no
locks. Bad input of any kind becomes an error reply (`ProtocolError`) raised
before any state changes; the loop never dies on a message.

Start-up: take the instance lock (proving no live sidecar owns the name),
remove a dead predecessor's socket and shm segments, create and pre-fault
the CPU tier, bind. Shutdown (SIGTERM/SIGINT): refuse new loads and saves,
let in-flight plans finish for up to `drain_seconds`, cancel the rest,
then unlink the shm segments, the socket and the lock.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import psutil
import zmq

from shm.layout import BlockLayout
from shm.pool import ShmPool, remove_stale_segments
from sidecar import protocol as p
from sidecar.config import Config
from sidecar.control.ids import GpuBlockIds
from sidecar.control.index import IndexConflict
from sidecar.control.plan import PlanError
from sidecar.control.planner import GlobalCacheEngine
from sidecar.dataplane import DataPlane, TierOps
from sidecar.engines import Engines, Session, namespace_of, pid_namespace
from sidecar.figures import server_stats
from sidecar.protocol import ErrorCode, ProtocolError
from sidecar.publisher import EventPublisher
from sidecar.remote_tier import RemoteTier
from sidecar.runtime import InstanceLock, endpoint_of, instance_paths
from sidecar.ssd import SsdStore
from sidecar.ssd_ops import SsdOps
from sidecar.stats import HitStats, split_hits
from sidecar.tiers import build_tiers
from sidecar.workers import IoPool

log = logging.getLogger("kvsidecar")

# Plain ints: zmq's IntFlag members cost ~2 us per operation in a hot loop.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

MAX_MESSAGE_BYTES = 64 << 20
MAX_STAGING_ATTEMPTS = 4
"""Stagings per load: a read that fails a checksum drops the bad block and
the next attempt stages the good prefix before it; CPU slots held by writes
in flight are waited for."""
POLL_MS = 100


def default_cpu_capacity() -> int:
    """10% of RAM, at most 16 GiB, at least 64 MiB."""
    total = psutil.virtual_memory().total
    return max(64 << 20, min(total // 10, 16 << 30))


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.paths = instance_paths(config)
        self.endpoint = endpoint_of(config)
        self.boot_id = uuid.uuid4().hex
        self.started = time.time()
        self.capacity = config.cpu_capacity or default_cpu_capacity()
        self.lock: InstanceLock | None = None
        self.pool: ShmPool | None = None
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.layout: BlockLayout | None = None
        self.cache: GlobalCacheEngine | None = None
        self.ssd: SsdStore | None = None
        self.io: IoPool | None = None
        self.dataplane: DataPlane | None = None
        self.remote: RemoteTier | None = None
        self._deferred: dict[int, tuple[bytes, p.Load, list[bytes], int]] = {}
        """Staging plan id -> the load waiting for it (identity, request, arrays, attempt)."""
        self._identity = b""
        self._waiting_for_io: list[tuple[bytes, p.Load, list[bytes], int]] = []
        self.engines = Engines(self._cancel_plan)
        self.hits = HitStats(config.hit_window)
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.stopping = False
        self.snapshot: dict[str, Any] = {}
        """Stats published for the metrics thread; replaced whole, never mutated."""
        self._metrics: Any = None
        self.publisher: EventPublisher | None = None
        self._next_lease_check = 0.0
        self._poller = zmq.Poller()
        self._handlers: dict[type, Callable[[Any, list[bytes]], p.Reply]] = {
            p.Register: self._register,
            p.Lookup: self._lookup,
            p.Exists: self._exists,
            p.Delete: self._delete,
            p.Load: self._load,
            p.Save: self._save,
            p.Complete: self._complete,
            p.Fail: self._fail,
            p.Cancel: self._cancel,
            p.Heartbeat: self._heartbeat,
            p.Unregister: self._unregister,
            p.Stats: self._stats,
        }

    # ---- life cycle ----------------------------------------------------------------

    def start(self) -> None:
        """Lock the instance, clean a dead predecessor's leftovers, create the
        CPU tier and bind. On failure, undo what was done and re-raise."""
        try:
            self.lock = InstanceLock(self.paths)
            stale = remove_stale_segments(self.paths.shm_prefix, self.config.shm_dir)
            if stale:
                log.warning("removed %d shm segment(s) left by a dead sidecar", len(stale))
            if self.endpoint.startswith("ipc://"):
                self.paths.socket_path.unlink(missing_ok=True)
            self.pool = ShmPool.create(
                self.paths.shm_prefix,
                self.capacity,
                directory=self.config.shm_dir,
                prefault=self.config.prefault,
            )
            if self.config.shm_dir and self.pool.page_kind == "4k":
                log.warning(
                    "shm_dir %s gave 4 KiB pages: mount it as hugetlbfs or tmpfs huge=always",
                    self.config.shm_dir,
                )
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.sock.bind(self.endpoint)
            self._poller.register(self.sock, zmq.POLLIN)
            if self.config.events_endpoint is not None:
                self.publisher = EventPublisher(
                    self.ctx,
                    self.config.events_endpoint,
                    self.config.events_resync_endpoint,
                    self.config.events_worker_id,
                )
                if self.publisher.resync is not None:
                    self._poller.register(self.publisher.resync, zmq.POLLIN)
            self.snapshot = self.stats()
            if self.config.metrics_port is not None:
                from sidecar.metrics import serve_metrics

                self._metrics = serve_metrics(self.config.metrics_port, lambda: self.snapshot)
        except BaseException:
            self.close()
            raise

    def handle_signals(self) -> None:
        """Make SIGTERM and SIGINT stop the loop gracefully. Call before
        `start`, so a signal during start-up is not fatal either."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def serve_forever(self) -> None:
        """Serve until `stopping` is set (by a signal), then drain and close."""
        try:
            while not self.stopping:
                self.poll_once()
            self._drain()
        finally:
            self.close()

    def poll_once(self, timeout_ms: int = POLL_MS) -> None:
        sock = self.sock
        assert sock is not None
        ready = dict(self._poller.poll(timeout_ms))
        if self.dataplane is not None:
            for io in self.dataplane.pools:
                if io.fd in ready:
                    self.dataplane.collect(io)
        if self.remote is not None:
            if self.remote.control_pool.fd in ready:
                self.remote.collect()
            self.remote.tick()
        # Asking EVENTS costs ~1 us; a recv that raises zmq.Again costs ~4.
        while sock.getsockopt(_EVENTS) & _POLLIN:
            self._serve_one(sock.recv_multipart(zmq.NOBLOCK))
        if self.publisher is not None:
            index = self.cache.cpu.index if self.cache is not None else None
            if index is not None:
                self.publisher.publish(index.drain_events())
            self.publisher.serve_resync(index)
        now = time.monotonic()
        if now >= self._next_lease_check:
            self.engines.expire(self.config.lease_seconds)
            self.snapshot = self.stats()
            self._next_lease_check = now + min(1.0, self.config.lease_seconds / 4)

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        self.stopping = True

    def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_seconds

        def busy() -> bool:
            probes = self.remote.pending_probes if self.remote else 0
            return bool(self.engines.plans or (self.dataplane and self.dataplane.plans) or probes)

        while busy() and time.monotonic() < deadline:
            self.poll_once(20)
        if self.remote is not None:
            self.remote.abandon_probes()
        for plan_id in list(self.engines.plans):
            self.engines.end(plan_id, cancel=True)
        if self.dataplane is not None:
            self.dataplane.abandon()
        for identity, req, _, _ in [*self._deferred.values(), *self._waiting_for_io]:
            self._send(identity, p.error(req.id, ErrorCode.SHUTTING_DOWN, "shutting down"))
        self._deferred.clear()
        self._waiting_for_io.clear()

    def close(self) -> None:
        """Release everything this process owns: socket, shm, lock (idempotent)."""
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.endpoint.startswith("ipc://") and self.lock is not None:
            self.paths.socket_path.unlink(missing_ok=True)
        if self.io is not None:  # threads may still read or write shm slots
            self.io.close()
            self.io = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None
        if self.pool is not None:
            self.pool.close()
            self.pool.unlink()
            self.pool = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---- dispatch ------------------------------------------------------------------

    def _serve_one(self, frames: list[bytes]) -> None:
        assert self.sock is not None
        identity, body = frames[0], frames[1:]
        self._identity = identity
        try:
            request, arrays = p.decode_request(body)
            op = type(request).__name__.lower()
            self.requests[op] += 1
            reply = self._handlers[type(request)](request, arrays)
            self._adopt_background()
        except ProtocolError as err:
            self.errors[err.code.value] += 1
            reply = p.error(p.request_id(body), err.code, err.message)
        except Exception as err:  # a bug must not take the sidecar down
            log.exception("internal error serving a request")
            self.errors[ErrorCode.INTERNAL.value] += 1
            reply = p.error(p.request_id(body), ErrorCode.INTERNAL, f"internal error: {err!r}")
        if reply is not None:  # None: answered later (a load waiting for SSD reads)
            self._send(identity, reply)

    def _send(self, identity: bytes, reply: p.Reply) -> None:
        assert self.sock is not None
        self.sock.send_multipart([identity, p.encode(reply.header), *reply.arrays], copy=True)

    def _adopt_background(self) -> None:
        """Write-backs created by CPU evictions go to the I/O pool."""
        if self.cache is not None and self.dataplane is not None:
            for plan in self.cache.drain_background():
                self.dataplane.adopt(plan)

    def _session(self, request: Any) -> Session:
        return self.engines.session(request.session)

    def _cancel_plan(self, plan_id: int) -> None:
        if self.cache is not None:
            self.cache.cancel(plan_id)
        if self.dataplane is not None:
            self.dataplane.forget(plan_id)

    def _not_stopping(self) -> None:
        if self.stopping:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")

    # ---- handlers ------------------------------------------------------------------

    def _register(self, req: p.Register, _: list[bytes]) -> p.Reply:
        self._not_stopping()
        kv = req.kv
        namespace = namespace_of(kv)
        layout = _layout_of(kv)
        if self.layout is not None and layout != self.layout:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"this sidecar serves blocks of {self.layout}, not {layout}; "
                "run one sidecar instance per KV layout",
            )
        self.engines.check_join(req.engine_id, req.session, kv, namespace)
        # Checks done: from here on the request changes state.
        if self.cache is None:
            self._create_cache(layout)
        pid = req.pid if req.pid_ns and req.pid_ns == pid_namespace() else 0
        self.engines.join(req.engine_id, req.session, kv, namespace, pid)
        assert self.pool is not None and self.layout is not None
        return p.ok(
            req.id,
            boot_id=self.boot_id,
            segments=list(self.pool.segment_names),
            segment_sizes=list(self.pool.segment_sizes),
            slot_stride=self.layout.slot_stride,
            num_slots=self.cache.cpu.capacity,  # type: ignore[union-attr]
            lease_seconds=self.config.lease_seconds,
        )

    def _create_cache(self, layout: BlockLayout) -> None:
        assert self.pool is not None
        tiers = build_tiers(self.config, self.pool, layout)
        self.cache, self.ssd, self.io, self.remote = tiers
        ops: list[TierOps] = []
        if self.ssd is not None and self.io is not None:
            ops.append(SsdOps(self.ssd, self.io, self.pool, layout))
        if self.remote is not None:
            ops.append(self.remote.ops)
        if ops:
            self.dataplane = DataPlane(self.cache, self.pool, layout, ops, self._plan_ended)
            for io in self.dataplane.pools:  # results wake the loop through their eventfds
                self._poller.register(io.fd, zmq.POLLIN)
        if self.remote is not None:
            self._poller.register(self.remote.control_pool.fd, zmq.POLLIN)
        self.layout = layout

    def _lookup(self, req: p.Lookup, arrays: list[bytes], probed: bool = False) -> p.Reply | None:
        self._session(req)
        keys = p.parse_keys(arrays[0])
        assert self.cache is not None
        if not probed and self._probe(keys, req.id, lambda: self._lookup(req, arrays, True)):
            return None
        counts = self.cache.lookup(keys)
        hits = split_hits(counts)
        self.hits.record(len(keys), hits)
        return p.ok(req.id, num_blocks=hits.total, cpu=hits.cpu, ssd=hits.ssd, remote=hits.remote)

    def _exists(self, req: p.Exists, arrays: list[bytes]) -> p.Reply:
        self._session(req)
        keys = p.parse_keys(arrays[0])
        assert self.cache is not None
        return p.ok(req.id, exists=split_hits(self.cache.lookup(keys)).total == len(keys))

    def _delete(self, req: p.Delete, arrays: list[bytes]) -> p.Reply:
        self._session(req)
        keys = p.parse_keys(arrays[0])
        assert self.cache is not None
        try:
            removed = self.cache.delete(keys)
        except IndexConflict as err:
            raise ProtocolError(ErrorCode.BUSY, str(err)) from None
        return p.ok(req.id, deleted_blocks=removed)

    def _load(
        self, req: p.Load, arrays: list[bytes], attempt: int = 0, probed: bool = False
    ) -> p.Reply | None:
        """A GET. Blocks past the CPU prefix that the SSD or the remote store
        holds are first staged into the CPU tier by the worker pools; the
        reply waits for that, so the engine only ever runs CPU->GPU copies."""
        self._not_stopping()
        session = self._session(req)
        keys, gpu = self._keys_and_blocks(session, arrays)
        if not 0 <= req.skip <= len(keys):
            raise ProtocolError(ErrorCode.BAD_VALUE, f"skip must be in [0, {len(keys)}]")
        assert self.cache is not None
        resume = functools.partial(self._load, req, arrays, 0, True)
        if attempt == 0 and not probed and self._probe(keys, req.id, resume):
            return None
        if self.dataplane is not None and attempt < MAX_STAGING_ATTEMPTS:
            stage = self.cache.get(keys, gpu, len(keys))  # lower tiers -> CPU only
            waiting = (self._identity, req, arrays, attempt + 1)
            if not stage.finished_on_return:
                self._deferred[stage.plan_id] = waiting
                self.dataplane.adopt(stage)
                return None
            counts = self.cache.lookup(keys)
            if max(counts.ssd, counts.remote) > counts.cpu and self.dataplane.plans:
                # No CPU slot free now: they are held by writes to SSD in
                # flight. Try again when one of those lands.
                self._waiting_for_io.append(waiting)
                return None
        plan = self.cache.get(keys, gpu, req.skip, stage=False)
        h = plan.hit_blocks
        fields = {"hit_blocks": h.total, "cpu": h.cpu, "ssd": h.ssd, "remote": h.remote}
        return self._plan_reply(req.id, session, plan, fields)

    def _save(self, req: p.Save, arrays: list[bytes]) -> p.Reply:
        self._not_stopping()
        session = self._session(req)
        keys, gpu = self._keys_and_blocks(session, arrays)
        assert self.cache is not None
        plan = self.cache.put(keys, gpu)
        fields = {
            "skipped_blocks": plan.skipped_blocks,
            "stored_blocks": plan.stored_blocks,
            "in_flight_blocks": plan.in_flight_blocks,
        }
        return self._plan_reply(req.id, session, plan, fields)

    def _probe(self, keys: Any, rid: int, resume: Callable[[], p.Reply | None]) -> bool:
        """Ask the remote store about keys past what this sidecar knows, when
        the double-get rule says so; `resume` answers the request once the
        probe is back. False when there is nothing to ask."""
        assert self.cache is not None
        start = None if self.remote is None else self.cache.remote_probe_start(keys)
        if start is None:
            return False
        identity = self._identity
        assert self.remote is not None
        self.remote.probe(keys, start, lambda: self._resume(identity, rid, resume))
        return True

    def _resume(self, identity: bytes, rid: int, answer: Callable[[], p.Reply | None]) -> None:
        """Answer a request whose reply waited (for a probe or a staging)."""
        self._identity = identity
        try:
            reply = answer()
        except ProtocolError as err:
            reply = p.error(rid, err.code, err.message)
        except Exception as err:  # a bug must not take the sidecar down
            log.exception("internal error answering a deferred request")
            self.errors[ErrorCode.INTERNAL.value] += 1
            reply = p.error(rid, ErrorCode.INTERNAL, f"internal error: {err!r}")
        if reply is not None:
            self._send(identity, reply)
        self._adopt_background()

    def _keys_and_blocks(self, session: Session, arrays: list[bytes]) -> tuple[Any, GpuBlockIds]:
        keys = p.parse_keys(arrays[0])
        gpu = p.parse_ids(arrays[1], "block_ids", len(keys), session.group.num_gpu_blocks)
        return keys, GpuBlockIds(gpu)

    def _plan_ended(self, plan_id: int, ok: bool) -> None:
        """A plan run by the data plane ended: answer a load waiting for it."""
        self.engines.end(plan_id, cancel=False)
        retry, self._waiting_for_io = self._waiting_for_io, []
        waiting = self._deferred.pop(plan_id, None)
        if waiting is not None:
            retry.append(waiting)
        for identity, req, arrays, attempt in retry:
            self._resume(identity, req.id, functools.partial(self._load, req, arrays, attempt))
        self._adopt_background()

    def _plan_reply(self, rid: int, session: Session, plan: Any, fields: dict) -> p.Reply:
        ops, arrays = [], []
        if not plan.finished_on_return:
            if self.dataplane is not None:
                self.dataplane.adopt(plan)  # its sidecar ops start when their deps are done
            state = self.engines.track(plan, session.group)
            for op in plan.graph.ops:
                if op.op_id in state.reported:
                    ops.append({"op_id": op.op_id, "kind": op.kind.value})
                    arrays += [p.ids_frame(op.src), p.ids_frame(op.dst)]
        return p.ok(rid, arrays, plan_id=plan.plan_id, ops=ops, **fields)

    def _complete(self, req: p.Complete, _: list[bytes]) -> p.Reply:
        session = self._session(req)
        state = self.engines.owned_plan(session, req.plan_id)
        state.check_report(session.rank, req.op_ids)
        assert self.cache is not None
        finished = False
        for op_id in req.op_ids:
            if state.report(session.rank, op_id):
                try:
                    finished = self.cache.complete(req.plan_id, op_id)
                except PlanError as err:  # e.g. its sidecar-side deps are not done
                    raise ProtocolError(ErrorCode.BAD_VALUE, str(err)) from None
        if finished or state.all_reported:
            # The engine's part is done; what is left (SSD writes) runs on the
            # I/O pool and no longer depends on the engine staying alive.
            self.engines.end(req.plan_id, cancel=False)
        if not finished and self.dataplane is not None:
            self.dataplane.pump(req.plan_id)
        return p.ok(req.id, finished=finished)

    def _fail(self, req: p.Fail, _: list[bytes]) -> p.Reply:
        session = self._session(req)
        state = self.engines.owned_plan(session, req.plan_id)
        if req.op_id not in state.reported:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"plan has no engine-side op {req.op_id}")
        log.warning(
            "engine %s failed plan %d: %s", session.group.engine_id, req.plan_id, req.reason
        )
        self.engines.end(req.plan_id, cancel=True)
        return p.ok(req.id)

    def _cancel(self, req: p.Cancel, _: list[bytes]) -> p.Reply:
        session = self._session(req)
        self.engines.owned_plan(session, req.plan_id)
        self.engines.end(req.plan_id, cancel=True)
        return p.ok(req.id)

    def _heartbeat(self, req: p.Heartbeat, _: list[bytes]) -> p.Reply:
        self._session(req)
        return p.ok(req.id, lease_seconds=self.config.lease_seconds)

    def _unregister(self, req: p.Unregister, _: list[bytes]) -> p.Reply:
        self.engines.drop(self._session(req), "unregistered")
        return p.ok(req.id)

    def _stats(self, req: p.Stats, _: list[bytes]) -> p.Reply:
        return p.ok(req.id, stats=self.stats())

    # ---- figures ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return server_stats(self)


def _layout_of(kv: p.KVLayoutMsg) -> BlockLayout:
    try:
        return BlockLayout(
            num_layers=kv.num_layers, layer_block_bytes=kv.layer_block_bytes, tp_size=kv.tp_size
        )
    except ValueError as err:
        raise ProtocolError(ErrorCode.BAD_VALUE, str(err)) from None
