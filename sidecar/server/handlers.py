"""The sidecar's request handlers: what each protocol op does to the cache.

`Server` (sidecar/server/server.py) owns the socket, the loop and the life
cycle, and hands each request to `Handlers.serve`. Every handler validates its
request completely (raising `ProtocolError`) before it changes any state,
and runs on the loop's thread: the index, mempool and plans need no locks.

A reply may wait: a lookup or load that must first ask the remote store
(`_probe`), or a load whose blocks are staged from SSD or the remote store
into the CPU tier, returns None and is answered later by `_resume`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from contract import protocol as p
from contract import replies as r
from contract.ids import BlockKeys, GpuBlockIds
from contract.protocol import ErrorCode, ProtocolError
from shm.copy import has_repeats
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.config import Config
from sidecar.control.hits import HitStats, split_hits
from sidecar.control.index import IndexConflict
from sidecar.control.plan import Plan, PlanError, TierCounts
from sidecar.metrics.latency import RequestLatency
from sidecar.namespace_limits import NamespaceName, parse_rules
from sidecar.server.admin import Admin
from sidecar.server.geometries import Geometries
from sidecar.server.hotpath import commit, grant, parse_touch
from sidecar.server.limits import check_register
from sidecar.server.namespaces import Namespaces
from sidecar.server.sessions import EngineGroup, Engines, Session, namespace_of, pid_namespace
from sidecar.server.waiting import WaitingLoad, WaitingLoads
from sidecar.tiers.tiered import TieredCache

log = logging.getLogger("kvsidecar")

MAX_STAGING_ATTEMPTS = 4
"""Stagings per load: a read that fails a checksum drops the bad block and
the next attempt stages the good prefix before it; CPU slots held by writes
in flight are waited for."""


class Answer(NamedTuple):
    """A reply and its array frames (a plan's op ids)."""

    reply: r.Ok | r.ErrorReply
    arrays: Sequence[bytes] = ()


class Handlers:
    """The protocol ops. Built whole at start-up with the parts they use.
    Each block geometry (layout) an engine brings gets a tiered cache of its
    own when its first engine registers (`geometries`); their CPU tiers
    share the shm pool through one `ExtentArena`, their SSD tiers the SSD budget
    through another (docs/sidecar.md, "Many models on one sidecar"). Every op but
    Register and Stats needs a session, so a cache exists for it."""

    def __init__(
        self,
        config: Config,
        boot_id: str,
        pool: ShmPool,
        send: Callable[[bytes, Any, Sequence[bytes]], None],
        watch: Callable[[int], None],
        figures: Callable[[], dict[str, Any]],
        admin_token: str,
    ) -> None:
        """`send(identity, header, arrays)` sends a reply; `watch(fd)` makes the
        loop wake when an I/O pool's fd is readable; `figures()` is what a
        Stats request answers; `admin_token` is what a Clear must carry."""
        self.config = config
        self.boot_id = boot_id
        self.pool = pool
        self._send_frames = send
        self._figures = figures
        self.geometries = Geometries(config, pool, self._plan_ended, watch)
        self.namespaces = Namespaces(parse_rules(config.namespace_limits))
        self.admin = Admin(admin_token, self.namespaces, self.geometries.realms)
        self.engines = Engines(
            self._cancel_plan, self._hold_cpu_slots, self._release_cpu_slots, self._free_cpu_slots
        )
        self.hits = HitStats(config.hit_window)
        self.waiting = WaitingLoads()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.transfers: Counter[str] = Counter()
        """Plans answered (`loads`, `saves`) and their blocks (`loaded_blocks`,
        `saved_blocks`)."""
        self.latency = RequestLatency({p.Lookup: "lookup", p.Load: "load", p.Save: "save"})
        self.stopping = False
        self._identity = b""
        """Who sent the request being handled (the ROUTER identity)."""
        self.dispatch: dict[type, Callable[[Any, list[bytes]], Answer | None]] = {
            p.Register: self._register,
            p.Lookup: self._lookup,
            p.Exists: self._exists,
            p.Delete: self._delete,
            p.Load: self._load,
            p.Save: self._save,
            p.Complete: self._complete,
            p.Fail: self._fail,
            p.Cancel: self._cancel,
            p.Touch: self._touch,
            p.Grant: self._grant,
            p.Commit: self._commit,
            p.Release: self._release,
            p.Heartbeat: self._heartbeat,
            p.Unregister: self._unregister,
            p.Stats: self._stats,
            p.Clear: self._clear,
        }

    def serve(self, frames: list[bytes]) -> None:
        """Answer one request (identity first); bad input of any kind becomes
        an error reply, raised before any state changes."""
        received = time.perf_counter()
        identity, body = frames[0], frames[1:]
        self._identity = identity
        histogram = None
        try:
            request, arrays = p.decode_request(body)
            histogram = self.latency.by_type.get(type(request))
            self.requests[type(request).__name__.lower()] += 1
            reply = self.dispatch[type(request)](request, arrays)
            self._adopt_background()
        except ProtocolError as err:
            self.errors[err.code.value] += 1
            reply = Answer(r.error(p.request_id(body), err.code, err.message))
        except Exception as err:  # a bug must not take the sidecar down
            log.exception("internal error serving a request")
            self.errors[ErrorCode.INTERNAL.value] += 1
            message = f"internal error: {err!r}"
            reply = Answer(r.error(p.request_id(body), ErrorCode.INTERNAL, message))
        if reply is not None:  # None: answered later (a load waiting for SSD reads)
            self._send(identity, reply)
            if histogram is not None:
                histogram.observe(time.perf_counter() - received)
        elif histogram is not None:
            self.latency.wait(identity, p.request_id(body), histogram, received)

    def _send(self, identity: bytes, answer: Answer) -> None:
        try:
            self._send_frames(identity, answer.reply, answer.arrays)
        except (TypeError, ValueError, OverflowError) as err:  # not encodable: a bug
            log.exception("internal error encoding a reply")
            self.errors[ErrorCode.INTERNAL.value] += 1
            error = r.error(getattr(answer.reply, "id", 0), ErrorCode.INTERNAL, repr(err))
            self._send_frames(identity, error, ())

    def refuse_waiting(self) -> None:
        """Shutting down: every load still waiting gets an error reply."""
        for identity, req, _, _ in self.waiting.take_all():
            self._send(identity, Answer(r.error(req.id, ErrorCode.SHUTTING_DOWN, "shutting down")))
            self.latency.answered(identity, req.id)

    def close(self) -> None:
        """Close the tiers (their I/O threads first; idempotent)."""
        self.geometries.close()

    def figures(self) -> dict[str, Any]:
        """What the handlers count: requests and errors by kind, hit ratios,
        plans in flight, the engines served."""
        plans = self.engines.plans.keys() | self.geometries.plan_ids()
        return {
            "hits": self.hits.snapshot(),
            # A plan with engine and sidecar ops is tracked by both: count it once.
            "plans_in_flight": len(plans),
            "orphaned_plans": len(self.engines.orphans),
            "engines": self.engines.describe(),
            "requests": dict(self.requests),
            "errors": dict(self.errors),
            "expired_sessions": self.engines.num_expired,
            "transfers": {
                "loads": self.transfers["loads"],
                "loaded_blocks": self.transfers["loaded_blocks"],
                "saves": self.transfers["saves"],
                "saved_blocks": self.transfers["saved_blocks"],
            },
            "latency": self.latency.figures(),
        }

    def expire(self) -> None:
        """Drop the blocks past their namespace's TTL that nothing holds."""
        if self.namespaces.has_ttl:
            self.geometries.expire()

    def _adopt_background(self) -> None:
        self.geometries.adopt_background()

    def _session(self, request: Any) -> Session:
        return self.engines.session(request.session)

    @staticmethod
    def _realm(session: Session) -> TieredCache:
        realm: TieredCache = session.group.realm
        return realm

    def _cancel_plan(self, group: EngineGroup, plan_id: int) -> None:
        """Roll a plan back (at once, or when its ops on I/O threads return)."""
        group.realm.cancel(plan_id)

    def _hold_cpu_slots(self, group: EngineGroup, slots: np.ndarray) -> None:
        group.realm.cache.cpu.mempool.hold(slots)

    def _release_cpu_slots(self, group: EngineGroup, slots: np.ndarray) -> None:
        group.realm.cache.cpu.mempool.release(slots)

    def _free_cpu_slots(self, group: EngineGroup, slots: np.ndarray) -> None:
        group.realm.cache.cpu.mempool.free(slots)

    def _not_stopping(self) -> None:
        if self.stopping:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")

    def _register(self, req: p.Register, _: list[bytes]) -> Answer:
        self._not_stopping()
        check_register(req)
        kv = req.kv
        namespace = namespace_of(kv)
        layout = _layout_of(kv)
        self.engines.check_join(req.engine_id, req.session, kv, namespace)
        name = NamespaceName(kv.model_name, kv.model_revision, kv.tenant)
        self._check_room(layout, name)
        # Checks done (a new geometry's cache checks that its blocks fit before
        # it changes anything): from here on the request changes state.
        realm = self.geometries.cache_of(layout)
        ns = self.namespaces.id_of(name)
        self.namespaces.apply(realm, ns)
        pid = req.pid if req.pid_ns and req.pid_ns == pid_namespace() else 0
        self.engines.join(req.engine_id, req.session, kv, namespace, pid, realm, ns)
        reply = r.RegisterReply(
            id=req.id,
            boot_id=self.boot_id,
            segments=list(self.pool.segment_names),
            segment_sizes=list(self.pool.segment_sizes),
            slot_stride=layout.slot_stride,
            num_slots=self.geometries.slots_of(layout),
            lease_seconds=self.config.lease_seconds,
            hot_index=self.geometries.hot.name_of(layout),
            features=list(p.FEATURES),
        )
        return Answer(reply)

    def _check_room(self, layout: BlockLayout, name: NamespaceName) -> None:
        """ProtocolError(BAD_VALUE) if a register would take a geometry or a
        namespace past `max_geometries` / `max_namespaces`: what either holds
        stays for the sidecar's life, so any client could exhaust it."""
        if layout not in self.geometries.realms and (
            len(self.geometries.realms) >= self.config.max_geometries
        ):
            raise ProtocolError(
                ErrorCode.BAD_VALUE,
                f"this sidecar serves {self.config.max_geometries} block geometries already "
                "(max_geometries)",
            )
        if not self.namespaces.knows(name) and len(self.namespaces) >= self.config.max_namespaces:
            raise ProtocolError(
                ErrorCode.BAD_VALUE,
                f"this sidecar tracks {self.config.max_namespaces} namespaces already "
                "(max_namespaces)",
            )

    def _lookup(self, req: p.Lookup, arrays: list[bytes], probed: bool = False) -> Answer | None:
        # Every lookup of every engine runs this while the others wait: kept flat.
        group = self.engines.session(req.session).group
        tiers: TieredCache = group.realm
        frame = arrays[0]
        num = p.num_keys(frame)
        cache = tiers.cache
        if cache.cpu.observes and not probed:  # for `auto`'s shadows, between requests
            cache.cpu.observe(p.parse_keys(frame), defer=True)
        if not cache.lower:  # a CPU-only cache: counted from the frame's bytes
            hits = TierCounts(cache.cpu.index.ready_blocks(frame))
        else:
            keys = p.parse_keys(frame)
            if (
                tiers.remote is not None  # else no probe: and no closure made for one
                and not probed
                and self._probe(
                    tiers, keys, req.id, lambda: self._lookup(req, arrays, True), group.ns_id
                )
            ):
                return None
            hits = split_hits(cache.lookup(keys))
        self.hits.record(num, hits)
        self.namespaces.lookups[group.ns_id] += num
        self.namespaces.hits[group.ns_id] += hits.cpu + hits.ssd + hits.remote
        reply = r.LookupReply(
            id=req.id,
            num_blocks=hits.cpu + hits.ssd + hits.remote,
            cpu=hits.cpu,
            ssd=hits.ssd,
            remote=hits.remote,
        )
        return Answer(reply)

    def _exists(self, req: p.Exists, arrays: list[bytes]) -> Answer:
        cache = self._realm(self._session(req)).cache
        keys = p.parse_keys(arrays[0])
        exists = split_hits(cache.lookup(keys)).total == len(keys)
        return Answer(r.ExistsReply(id=req.id, exists=exists))

    def _delete(self, req: p.Delete, arrays: list[bytes]) -> Answer:
        cache = self._realm(self._session(req)).cache
        keys = p.parse_keys(arrays[0])
        try:
            removed = cache.delete(keys)
        except IndexConflict as err:
            raise ProtocolError(ErrorCode.BUSY, str(err)) from None
        return Answer(r.DeleteReply(id=req.id, deleted_blocks=removed))

    def _load(
        self, req: p.Load, arrays: list[bytes], attempt: int = 0, probed: bool = False
    ) -> Answer | None:
        """A GET. Blocks past the CPU prefix that the SSD or the remote store
        holds are first staged into the CPU tier by the worker pools; the
        reply waits for that, so the engine only ever runs CPU->GPU copies.
        A part of a load asked for in parts (`req.end`) stages the whole
        load's blocks, made ready part by part, and is answered once its own
        are ready; the later parts find them staged or being staged."""
        self._not_stopping()
        session = self._session(req)
        keys, gpu = self._keys_and_blocks(session, arrays, req.skip)
        end = req.end or len(keys)
        if not req.skip <= end <= len(keys):
            raise ProtocolError(ErrorCode.BAD_VALUE, f"end must be 0 or in [skip, {len(keys)}]")
        realm, ns = self._realm(session), session.group.ns_id
        cache = realm.cache
        resume = functools.partial(self._load, req, arrays, 0, True)
        if attempt == 0 and not probed and self._probe(realm, keys, req.id, resume, ns):
            return None
        dataplane = realm.dataplane
        if dataplane is not None and attempt < MAX_STAGING_ATTEMPTS:
            if dataplane.plans and cache.filling_from_below(BlockKeys(keys[:end])):
                # Blocks a staging is filling right now (another load's of the
                # same prefix, or this load's earlier part's) are waited for
                # without using up a try: that plan's progress brings it back.
                # (First: a part waits so, and is tried again as each part lands.)
                self.waiting.wait_fill(
                    WaitingLoad(self._identity, req, arrays, attempt), self._progress()
                )
                return None
            step = end - req.skip
            ready_at = range(end, len(keys), step) if end < len(keys) and step else ()
            # Lower tiers -> CPU:
            stage = cache.get(keys, gpu, len(keys), hit=False, ns=ns, ready_at=ready_at)
            # Its evictions may have started write-backs (write_back policy):
            # running now, they are plans in flight whose end frees CPU slots.
            self._adopt_background()
            waiting = WaitingLoad(self._identity, req, arrays, attempt + 1)
            if not stage.finished_on_return:
                dataplane.adopt(stage)
                if end == len(keys):
                    self.waiting.defer(stage.plan_id, waiting)
                else:  # answered once its own part is ready, the staging ended or not
                    self.waiting.wait_fill(waiting, self._progress())
                return None
            counts = cache.lookup(keys)  # the double-get rule: for the whole load
            if min(max(counts.ssd, counts.remote), end) > counts.cpu and dataplane.plans:
                # No CPU slot free now: they are held by writes to SSD in
                # flight or by engines' open plans. Try again when a slot may
                # have come free (retry_parked) or a data-plane plan ends.
                self.waiting.park(waiting, self._room())
                return None
        plan = cache.get(
            keys,
            gpu,
            req.skip,
            stage=False,
            ns=ns,
            hit=end == len(keys),  # a load in parts is one hit, with its last part
            end=end,  # copies its own part; locks the staged blocks of the parts after it
        )
        ops, op_arrays = self._engine_ops(session, plan)
        h = plan.hit_blocks
        self.transfers["loads"] += 1
        self.transfers["loaded_blocks"] += h.total
        reply = r.LoadReply(
            id=req.id,
            plan_id=plan.plan_id,
            boot_id=self.boot_id,
            ops=ops,
            hit_blocks=h.total,
            cpu=h.cpu,
            ssd=h.ssd,
            remote=h.remote,
        )
        return Answer(reply, op_arrays)

    def _save(self, req: p.Save, arrays: list[bytes]) -> Answer:
        self._not_stopping()
        session = self._session(req)
        keys, gpu = self._keys_and_blocks(session, arrays, req.skip)
        plan = self._realm(session).cache.put(keys, gpu, session.group.ns_id, req.skip)
        ops, op_arrays = self._engine_ops(session, plan, req.shared_early)
        self.transfers["saves"] += 1
        self.transfers["saved_blocks"] += plan.stored_blocks
        reply = r.SaveReply(
            id=req.id,
            plan_id=plan.plan_id,
            boot_id=self.boot_id,
            ops=ops,
            skipped_blocks=plan.skipped_blocks,
            stored_blocks=plan.stored_blocks,
            in_flight_blocks=plan.in_flight_blocks,
        )
        return Answer(reply, op_arrays)

    def _probe(
        self,
        realm: TieredCache,
        keys: Any,
        rid: int,
        resume: Callable[[], Answer | None],
        ns: int,
    ) -> bool:
        """Ask the remote store about keys past what this sidecar knows, when
        the double-get rule says so; `resume` answers the request once the
        probe is back. False when there is nothing to ask."""
        remote = realm.remote
        start = None if remote is None else realm.cache.remote_probe_start(keys)
        if remote is None or start is None:
            return False
        identity = self._identity
        remote.probe(keys, start, lambda: self._resume(identity, rid, resume), ns)
        return True

    def _resume(self, identity: bytes, rid: int, answer: Callable[[], Answer | None]) -> None:
        """Answer a request whose reply waited (for a probe or a staging)."""
        self._identity = identity
        try:
            reply = answer()
        except ProtocolError as err:
            reply = Answer(r.error(rid, err.code, err.message))
        except Exception as err:  # a bug must not take the sidecar down
            log.exception("internal error answering a deferred request")
            self.errors[ErrorCode.INTERNAL.value] += 1
            reply = Answer(r.error(rid, ErrorCode.INTERNAL, f"internal error: {err!r}"))
        if reply is not None:
            self._send(identity, reply)
            self.latency.answered(identity, rid)
        self._adopt_background()

    def _keys_and_blocks(
        self, session: Session, arrays: list[bytes], skip: int
    ) -> tuple[Any, GpuBlockIds]:
        """The keys and engine block ids of a load or save whose first `skip`
        blocks are not copied (their ids are not checked for repeats)."""
        group = session.group
        if len(group.sessions) < group.tp_size:
            raise ProtocolError(
                ErrorCode.RANKS_MISSING,
                f"engine {group.engine_id!r} has {len(group.sessions)} of its "
                f"{group.tp_size} TP ranks registered; a plan needs every rank",
            )
        keys = p.parse_keys(arrays[0])
        gpu = p.parse_ids(arrays[1], "block_ids", len(keys), group.num_gpu_blocks)
        if not 0 <= skip <= len(keys):
            raise ProtocolError(ErrorCode.BAD_VALUE, f"skip must be in [0, {len(keys)}]")
        if has_repeats(gpu[skip:]):
            # Saved, one engine block would be stored under several keys (wrong
            # KV for every engine that loads them); loaded, copied into twice.
            raise ProtocolError(
                ErrorCode.BAD_VALUE, "block_ids repeat: each block needs its own engine block"
            )
        return keys, GpuBlockIds(gpu)

    def _plan_ended(self, plan_id: int, ok: bool) -> None:
        """A plan run by the data plane ended: answer a load waiting for it."""
        self.engines.end(plan_id, cancel=False)
        self._retry_waiting(plan_id)

    def retry_parked(self) -> None:
        """Try the parked loads again if a CPU slot may have come free since
        they were parked (`_room`: an engine's save given up freed its
        slots, a load's end left its blocks evictable); and the loads
        waiting for a staging's blocks if some became ready since. (Plans
        run by the data plane retry them as they end, in `_plan_ended`.)
        A plan whose end frees nothing (a load whose blocks sit above blocks
        still in flight, a staged part made ready) does not retry the parked
        loads: each try of theirs costs one of their MAX_STAGING_ATTEMPTS."""
        waiting = self.waiting
        if not waiting.waiting:
            return
        idle = bool(waiting.parked) and self._idle()
        if waiting.due(self._room(), self._progress(), idle):
            self._retry_waiting(None)

    def _retry_waiting(self, plan_id: int | None) -> None:
        """Try the waiting loads whose trigger came (`plan_id`: a data-plane
        plan ended), in this order: the staging's own load, the loads waiting
        for a filling whose blocks are all ready now (they only lock and
        copy), the other filling loads (which may stage), and last the parked
        ones, only if some CPU slot could be had now (`_room_now`): their
        tries are few, and the loads before them may have just locked
        whatever a plan's end left evictable."""
        waiting = self.waiting
        self._retry_loads(self._ready_first(waiting.take_unparked(plan_id, self._progress())))
        if not waiting.parked:
            return
        # A load parks only while a data-plane plan is in flight; one rolled
        # back (an engine gave up its save) reports no end and may free
        # nothing (its slots held for an orphan): with none left, try them.
        idle = self._idle()
        if idle or self._room_now():
            self._retry_loads(waiting.take_parked(plan_id is not None, self._room(), idle))
        else:
            waiting.no_room(self._room())

    def _idle(self) -> bool:
        """No data-plane plan is in flight (in any geometry)."""
        return not any(
            realm.dataplane is not None and realm.dataplane.plans for realm in self.geometries
        )

    def _room_now(self) -> bool:
        """Whether a staging could get a CPU slot now: a free or evictable
        slot in some geometry, or slots of the arena no geometry owns."""
        for realm in self.geometries:
            cpu = realm.cache.cpu
            if cpu.mempool.num_free or cpu.index.next_victim_age() is not None:
                return True
        arena = self.geometries.arena
        return any(arena.unowned_slots(realm.layout.slot_stride) for realm in self.geometries)

    def _ready_first(self, loads: list[WaitingLoad]) -> list[WaitingLoad]:
        """`loads` with those whose asked blocks are all ready in the CPU
        tier first (order kept otherwise)."""
        if len(loads) < 2:
            return loads
        ready: list[WaitingLoad] = []
        rest: list[WaitingLoad] = []
        for load in loads:
            (ready if self._all_ready(load) else rest).append(load)
        return ready + rest

    def _all_ready(self, load: WaitingLoad) -> bool:
        session = self.engines.sessions.get(load.request.session)  # its lease not renewed
        if session is None:
            return True  # answered at once: an error
        keys = p.parse_keys(load.arrays[0])  # parsed once already: well formed
        end = load.request.end or len(keys)
        cpu = self._realm(session).cache.cpu
        return bool(cpu.match(BlockKeys(keys[:end])).num_blocks >= end)

    def _room(self) -> int:
        """A count that grows when a CPU slot may have come free: one was
        freed (an eviction's too: over-counting costs a try, never a
        wake-up), or a block became evictable."""
        return sum(
            realm.cache.cpu.mempool.vacated + realm.cache.cpu.index.became_evictable
            for realm in self.geometries
        )

    def _progress(self) -> int:
        """A count that grows when a plan ends, or a staging makes the front
        of its blocks ready: then loads waiting for a filling may get further."""
        readied = sum(realm.cache.cpu.index.fronts_readied for realm in self.geometries)
        return self.engines.num_ended + readied

    def _retry_loads(self, retry: list[WaitingLoad]) -> None:
        for identity, req, arrays, attempt in retry:
            retried = functools.partial(self._load, req, arrays, attempt, True)  # probed once
            self._resume(identity, req.id, retried)
        self._adopt_background()

    def _engine_ops(
        self, session: Session, plan: Plan, shared_early: bool = False
    ) -> tuple[list[r.PlanOp], list[bytes]]:
        """Track an unfinished plan; its engine-side ops, and their source and
        destination ids as array frames."""
        ops: list[r.PlanOp] = []
        arrays: list[bytes] = []
        if not plan.finished_on_return:
            dataplane = self._realm(session).dataplane
            if dataplane is not None:
                dataplane.adopt(plan)  # its sidecar ops start when their deps are done
            state = self.engines.track(plan, session, shared_early)
            for op in plan.graph.ops:
                if op.op_id in state.reported:
                    ops.append(r.PlanOp(op.op_id, op.kind))
                    arrays += [p.ids_frame(op.src), p.ids_frame(op.dst)]
        return ops, arrays

    def _complete(self, req: p.Complete, _: list[bytes]) -> Answer:
        self.engines.writer_done(req.session, req.plan_id)
        session = self._session(req)
        state = self.engines.owned_plan(session, req.plan_id)
        state.check_report(session.rank, req.op_ids)
        realm = self._realm(session)
        cache = realm.cache
        finished = False
        for op_id in req.op_ids:
            if state.report(session.rank, op_id):
                try:
                    finished = cache.complete(req.plan_id, op_id)
                except PlanError as err:  # e.g. its sidecar-side deps are not done
                    raise ProtocolError(ErrorCode.BAD_VALUE, str(err)) from None
        if finished or state.all_reported:
            # The engine's part is done; what is left (SSD writes) runs on the
            # I/O pool and no longer depends on the engine staying alive.
            self.engines.end(req.plan_id, cancel=False)
        dataplane = realm.dataplane
        if dataplane is not None:
            if finished:  # the sidecar's ops of this plan (if any) landed before
                dataplane.ended(req.plan_id)
            else:
                dataplane.pump(req.plan_id)
        return Answer(r.CompleteReply(id=req.id, finished=finished))

    def _fail(self, req: p.Fail, _: list[bytes]) -> Answer:
        self.engines.writer_done(req.session, req.plan_id)
        session = self._session(req)
        state = self.engines.owned_plan(session, req.plan_id)
        if req.op_id not in state.reported:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"plan has no engine-side op {req.op_id}")
        log.warning(
            "engine %s failed plan %d: %s", session.group.engine_id, req.plan_id, req.reason
        )
        self.engines.give_up(session, req.plan_id)
        return Answer(r.Ok(id=req.id))

    def _cancel(self, req: p.Cancel, _: list[bytes]) -> Answer:
        self.engines.writer_done(req.session, req.plan_id)
        session = self._session(req)
        self.engines.owned_plan(session, req.plan_id)
        self.engines.give_up(session, req.plan_id)
        return Answer(r.Ok(id=req.id))

    def _touch(self, req: p.Touch, arrays: list[bytes]) -> Answer:
        """An engine's batch of lookups and loads done through the hot index."""
        group = self._session(req).group
        lookups, loads, chains = parse_touch(req, arrays)  # checked whole first
        ns = group.ns_id
        for asked, hit in lookups:
            self.hits.record(asked, TierCounts(hit))
            self.namespaces.lookups[ns] += asked
            self.namespaces.hits[ns] += hit
        cpu = self._realm(self._session(req)).cache.cpu
        for keys in chains:  # for `auto`'s shadows, worked off between requests
            cpu.observe(keys, defer=True)
        for keys, skipped in loads:  # recency and hit counts, as a load's GET gives them
            cpu.match(keys, touch=True)
            self.transfers["loaded_blocks"] += len(keys) - skipped
        self.transfers["loads"] += len(loads)
        return Answer(r.Ok(id=req.id))

    def _grant(self, req: p.Grant, _: list[bytes]) -> Answer:
        self._not_stopping()
        session = self._session(req)
        realm = self._realm(session)
        if session.group.tp_size != 1:
            raise ProtocolError(ErrorCode.BAD_VALUE, "grants need TP 1")
        if req.id == session.abandoned_grant:  # given up by a release that came first
            slots = np.empty(0, dtype=np.int64)
        else:
            slots = grant(session, realm.cache.cpu, req.want)
        return Answer(r.GrantReply(id=req.id, count=int(slots.size)), [p.ids_frame(slots)])

    def _commit(self, req: p.Commit, arrays: list[bytes]) -> Answer:
        session = self._session(req)
        if req.boot_id != self.boot_id:
            raise ProtocolError(ErrorCode.BAD_VALUE, "slots granted by another boot of the sidecar")
        keys = p.parse_keys(arrays[0])
        cache = self._realm(session).cache
        slots = p.parse_ids(arrays[1], "slots", len(keys) - req.first, cache.cpu.mempool.space)
        ns = session.group.ns_id
        stored, dropped, cached = commit(session, cache, keys, slots, req.first, ns)
        self.transfers["saves"] += 1
        self.transfers["saved_blocks"] += stored
        return Answer(r.CommitReply(id=req.id, stored=stored, dropped=dropped, cached=cached))

    def _release(self, req: p.Release, _: list[bytes]) -> Answer:
        session = self._session(req)
        if req.boot_id != self.boot_id:
            raise ProtocolError(ErrorCode.BAD_VALUE, "slots granted by another boot of the sidecar")
        self.engines.release_grant(session, req.abandoned_grant)
        return Answer(r.Ok(id=req.id))

    def _heartbeat(self, req: p.Heartbeat, _: list[bytes]) -> Answer:
        self._session(req)
        reply = r.HeartbeatReply(
            id=req.id, lease_seconds=self.config.lease_seconds, boot_id=self.boot_id
        )
        return Answer(reply)

    def _unregister(self, req: p.Unregister, _: list[bytes]) -> Answer:
        self.engines.unregister(self._session(req))
        return Answer(r.Ok(id=req.id))

    def _stats(self, req: p.Stats, _: list[bytes]) -> Answer:
        return Answer(r.StatsReply(id=req.id, stats=self._figures()))

    def _clear(self, req: p.Clear, _: list[bytes]) -> Answer:
        return Answer(self.admin.clear(req))


def _layout_of(kv: p.KVLayoutMsg) -> BlockLayout:
    try:
        return BlockLayout(
            num_layers=kv.num_layers, layer_block_bytes=kv.layer_block_bytes, tp_size=kv.tp_size
        )
    except ValueError as err:
        raise ProtocolError(ErrorCode.BAD_VALUE, str(err)) from None
