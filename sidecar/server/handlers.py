"""The sidecar's request handlers: what each protocol op does to the cache.

`Server` (sidecar/server/server.py) owns the socket, the loop and the life cycle,
and dispatches each decoded request here. Every handler validates its
request completely (raising `ProtocolError`) before it changes any state,
and runs on the loop's thread: the index, mempool and plans need no locks.

A reply may wait: a lookup or load that must first ask the remote store
(`_probe`), or a load whose blocks are staged from SSD or the remote store
into the CPU tier, returns None and is answered later by `_resume`.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from contract import protocol as p
from contract.ids import GpuBlockIds
from contract.protocol import ErrorCode, ProtocolError
from shm.copy import has_repeats
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.config import Config
from sidecar.control.hits import HitStats, split_hits
from sidecar.control.index import IndexConflict
from sidecar.control.plan import PlanError, TierCounts
from sidecar.control.planner import GlobalCacheEngine
from sidecar.server.sessions import Engines, Session, namespace_of, pid_namespace
from sidecar.tiers.build import build_tiers
from sidecar.tiers.dataplane import DataPlane, TierOps
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.remote.tier import RemoteTier
from sidecar.tiers.ssd.ops import SsdOps
from sidecar.tiers.ssd.store import SsdStore

log = logging.getLogger("kvsidecar")

MAX_STAGING_ATTEMPTS = 4
"""Stagings per load: a read that fails a checksum drops the bad block and
the next attempt stages the good prefix before it; CPU slots held by writes
in flight are waited for."""


class Handlers:
    """The protocol ops, as methods of the sidecar (`Server` inherits them).
    The state they read and change is the server's own:"""

    config: Config
    boot_id: str
    pool: ShmPool | None
    layout: BlockLayout | None
    cache: GlobalCacheEngine | None
    ssd: SsdStore | None
    io: IoPool | None
    dataplane: DataPlane | None
    remote: RemoteTier | None
    engines: Engines
    hits: HitStats
    errors: Counter[str]
    stopping: bool
    _identity: bytes
    """Who sent the request being handled (the ROUTER identity)."""
    _deferred: dict[int, tuple[bytes, p.Load, list[bytes], int]]
    """Staging plan id -> the load waiting for it (identity, request, arrays, attempt)."""
    _waiting_for_io: list[tuple[bytes, p.Load, list[bytes], int]]
    """Loads parked until a CPU slot may have come free (see `retry_parked`)."""
    _parked_at: int
    """`engines.num_ended` when the parked loads were last tried."""
    _poller: zmq.Poller

    def _send(self, identity: bytes, reply: p.Reply) -> None:
        """Send a reply on the server's socket (`Server._send`)."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """The server's figures (`Server.stats`)."""
        raise NotImplementedError

    def _adopt_background(self) -> None:
        """Write-backs created by CPU evictions go to the I/O pool."""
        if self.cache is not None and self.dataplane is not None:
            for plan in self.cache.drain_background():
                self.dataplane.adopt(plan)

    def _session(self, request: Any) -> Session:
        return self.engines.session(request.session)

    def _cancel_plan(self, plan_id: int) -> None:
        """Roll a plan back (at once, or when its ops on I/O threads return)."""
        if self.dataplane is not None:
            self.dataplane.cancel(plan_id)
        elif self.cache is not None:
            self.cache.cancel(plan_id)

    def _hold_cpu_slots(self, slots: np.ndarray) -> None:
        if self.cache is not None:
            self.cache.cpu.mempool.hold(slots)

    def _release_cpu_slots(self, slots: np.ndarray) -> None:
        if self.cache is not None:
            self.cache.cpu.mempool.release(slots)

    def _not_stopping(self) -> None:
        if self.stopping:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")

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
        if req.pid < 0:
            raise ProtocolError(
                ErrorCode.BAD_VALUE, f"pid must be >= 0 (0: unknown), got {req.pid}"
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
        # Every lookup of every engine runs this while the others wait: kept flat.
        self.engines.session(req.session)
        frame = arrays[0]
        num = p.num_keys(frame)
        cache = self.cache
        assert cache is not None
        if not cache.lower:  # a CPU-only cache: counted from the frame's bytes
            hits = TierCounts(cache.cpu.index.ready_blocks(frame))
        else:
            keys = p.parse_keys(frame)
            if (
                self.remote is not None  # else no probe: and no closure made for one
                and not probed
                and self._probe(keys, req.id, lambda: self._lookup(req, arrays, True))
            ):
                return None
            hits = split_hits(cache.lookup(keys))
        self.hits.record(num, hits)
        return p.lookup_reply(req.id, *hits)

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
            stage = self.cache.get(keys, gpu, len(keys), hit=False)  # lower tiers -> CPU only
            # Its evictions may have started write-backs (write_back policy):
            # running now, they are plans in flight whose end frees CPU slots.
            self._adopt_background()
            waiting = (self._identity, req, arrays, attempt + 1)
            if not stage.finished_on_return:
                self._deferred[stage.plan_id] = waiting
                self.dataplane.adopt(stage)
                return None
            counts = self.cache.lookup(keys)
            if max(counts.ssd, counts.remote) > counts.cpu and self.dataplane.plans:
                # No CPU slot free now: they are held by writes to SSD in
                # flight or by engines' open plans. Try again when a plan ends.
                # Blocks that another plan is filling right now (another load
                # staging the same prefix) are waited for without using up a
                # try: their plan's end brings this load back.
                cpu = self.cache.cpu.match(keys)
                if cpu.num_present > cpu.num_blocks:
                    waiting = (self._identity, req, arrays, attempt)
                self._waiting_for_io.append(waiting)
                self._parked_at = self.engines.num_ended
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
        group = session.group
        if len(group.sessions) < group.tp_size:
            raise ProtocolError(
                ErrorCode.RANKS_MISSING,
                f"engine {group.engine_id!r} has {len(group.sessions)} of its "
                f"{group.tp_size} TP ranks registered; a plan needs every rank",
            )
        keys = p.parse_keys(arrays[0])
        gpu = p.parse_ids(arrays[1], "block_ids", len(keys), group.num_gpu_blocks)
        if has_repeats(gpu):
            # Saved, one engine block would be stored under several keys (wrong
            # KV for every engine that loads them); loaded, copied into twice.
            raise ProtocolError(
                ErrorCode.BAD_VALUE, "block_ids repeat: each block needs its own engine block"
            )
        return keys, GpuBlockIds(gpu)

    def _plan_ended(self, plan_id: int, ok: bool) -> None:
        """A plan run by the data plane ended: answer a load waiting for it."""
        self.engines.end(plan_id, cancel=False)
        waiting = self._deferred.pop(plan_id, None)
        self._retry_loads([] if waiting is None else [waiting])

    def retry_parked(self) -> None:
        """Try the parked loads again if a plan has ended since they were
        parked: an engine's save completed or was given up, a load released
        its locks, so a CPU slot may be free. (Plans run by the data plane
        retry them as they end, in `_plan_ended`.)"""
        if self._waiting_for_io and self.engines.num_ended != self._parked_at:
            self._retry_loads([])

    def _retry_loads(self, ready: list[tuple[bytes, p.Load, list[bytes], int]]) -> None:
        retry, self._waiting_for_io = [*self._waiting_for_io, *ready], []
        self._parked_at = self.engines.num_ended
        for identity, req, arrays, attempt in retry:
            retried = functools.partial(self._load, req, arrays, attempt, True)  # probed once
            self._resume(identity, req.id, retried)
        self._adopt_background()

    def _plan_reply(self, rid: int, session: Session, plan: Any, fields: dict) -> p.Reply:
        ops, arrays = [], []
        if not plan.finished_on_return:
            if self.dataplane is not None:
                self.dataplane.adopt(plan)  # its sidecar ops start when their deps are done
            state = self.engines.track(plan, session)
            for op in plan.graph.ops:
                if op.op_id in state.reported:
                    ops.append({"op_id": op.op_id, "kind": op.kind.value})
                    arrays += [p.ids_frame(op.src), p.ids_frame(op.dst)]
        return p.ok(rid, arrays, plan_id=plan.plan_id, boot_id=self.boot_id, ops=ops, **fields)

    def _complete(self, req: p.Complete, _: list[bytes]) -> p.Reply:
        self.engines.writer_done(req.session, req.plan_id)
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
        if self.dataplane is not None:
            if finished:  # the sidecar's ops of this plan (if any) landed before
                self.dataplane.ended(req.plan_id)
            else:
                self.dataplane.pump(req.plan_id)
        return p.ok(req.id, finished=finished)

    def _fail(self, req: p.Fail, _: list[bytes]) -> p.Reply:
        self.engines.writer_done(req.session, req.plan_id)
        session = self._session(req)
        state = self.engines.owned_plan(session, req.plan_id)
        if req.op_id not in state.reported:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"plan has no engine-side op {req.op_id}")
        log.warning(
            "engine %s failed plan %d: %s", session.group.engine_id, req.plan_id, req.reason
        )
        self.engines.give_up(session, req.plan_id)
        return p.ok(req.id)

    def _cancel(self, req: p.Cancel, _: list[bytes]) -> p.Reply:
        self.engines.writer_done(req.session, req.plan_id)
        session = self._session(req)
        self.engines.owned_plan(session, req.plan_id)
        self.engines.give_up(session, req.plan_id)
        return p.ok(req.id)

    def _heartbeat(self, req: p.Heartbeat, _: list[bytes]) -> p.Reply:
        self._session(req)
        return p.ok(req.id, lease_seconds=self.config.lease_seconds, boot_id=self.boot_id)

    def _unregister(self, req: p.Unregister, _: list[bytes]) -> p.Reply:
        self.engines.drop(self._session(req), "unregistered")
        return p.ok(req.id)

    def _stats(self, req: p.Stats, _: list[bytes]) -> p.Reply:
        return p.ok(req.id, stats=self.stats())


def _layout_of(kv: p.KVLayoutMsg) -> BlockLayout:
    try:
        return BlockLayout(
            num_layers=kv.num_layers, layer_block_bytes=kv.layer_block_bytes, tp_size=kv.tp_size
        )
    except ValueError as err:
        raise ProtocolError(ErrorCode.BAD_VALUE, str(err)) from None
