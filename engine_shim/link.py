"""`SidecarLink`: what one client session holds of the sidecar it talks to.

The socket, what the engine registered, the sidecar's shm mapped into this
process, the copier between the engine's tensors and that shm, the thread
that renews the lease, the hot index; and the engine side of the sidecar's
plans (copy, then report). `KVClient` is the engine-facing API over it.

A sidecar restart is met here: the heartbeat or a call hears a new boot id,
and the next call or plan registers again and maps the new pool (unmapping
the old one, whose RAM this mapping alone would keep). A plan made by a
sidecar that has restarted since is never reported: it died with it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from contract import protocol as p
from contract import replies as r
from contract.endpoint import CurveClientKeys
from contract.protocol import ErrorCode
from cuda_ext.copier import BlockCopier, open_copier
from engine_shim.channel import Channel, SidecarError, SidecarUnavailable
from engine_shim.heartbeat import Heartbeat
from engine_shim.hotpath import HotLane
from engine_shim.registration import RegisterFields, Registration
from engine_shim.transfer import (
    Copy,
    EngineOp,
    LayeredTransfer,
    PlanOps,
    TransferHandle,
    queue_copies,
)
from shm.layout import BlockLayout
from shm.pool import ShmPool, ShmPoolError

MAX_RAN = 4096
"""Plans a rank remembers having run (about 0.5 MiB in all): far more than
an engine has in flight, so a plan delivered twice is still known."""


class SidecarLink:
    def __init__(
        self, endpoint: str, timeout: float, session: str, curve: CurveClientKeys | None
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.session = session
        self._curve = curve
        self.channel = Channel(endpoint, timeout, curve=curve)
        self.channel.on_stray_plan = self.give_back
        self.registered: Registration | None = None
        """What `take` last took (None before); kept once closed, for its keys."""
        self.registrations = 0
        """How many times `take` has taken new tensors (a refused one does not count)."""
        self.pool: ShmPool | None = None
        self.boot_id: str | None = None
        """The boot of the sidecar whose shm is mapped here."""
        self.live_boot: str | None = None
        """The boot the heartbeat last heard from (set by its thread)."""
        self.copier: BlockCopier | None = None
        """Between the registered tensors and the mapped pool: closed with either."""
        self.layout: BlockLayout | None = None
        self.lease_seconds = 0.0
        self.features: frozenset[str] = frozenset()
        """What the sidecar takes beyond the base protocol (RegisterReply)."""
        self.hot = HotLane(
            self.channel,
            session,
            lease=lambda: self.lease_seconds,
            handle=lambda num_tokens, ack, count: self.handle(None, num_tokens, ack, count=count),
        )
        """The hot index of the sidecar whose pool is mapped, and what goes through it."""
        self.heartbeat: Heartbeat | None = None
        self.closed = False
        self._ran: dict[tuple[str, int], None] = {}
        """The latest plans this rank ran or gave back (boot, plan id), oldest
        first: a plan runs once (run again, a save would copy the engine's
        blocks as they are now into slots that may hold other blocks)."""
        self._ran_lock = threading.Lock()

    def req(self, kind: type, **fields: Any) -> Any:
        return kind(v=p.PROTOCOL_VERSION, id=0, session=self.session, **fields)

    # ---- registration ------------------------------------------------------------

    @property
    def register_args(self) -> RegisterFields | None:
        """The Register request's own fields as last registered (None before,
        and once closed)."""
        return None if self.registered is None or self.closed else self.registered.fields

    def registration(self) -> Registration:
        """What `take` last took; RuntimeError before it, or once closed."""
        if self.registered is None:
            raise RuntimeError("this client is closed" if self.closed else "register() first")
        return self.registered

    def take(self, registration: Registration) -> None:
        """Register `registration` in place of the one held, whole. Refused
        (SidecarError): the previous one is back as it was, as the sidecar
        keeps it. Unanswered, or refused by a sidecar that is shutting down
        (SidecarUnavailable): the new one stays, and is registered when a
        sidecar answers."""
        previous, self.registered = self.registered, registration
        try:
            reply, _ = self.channel.call(registration.request(self.session))
        except SidecarError as err:
            if err.code is ErrorCode.SHUTTING_DOWN:  # going away: as if it had not answered
                raise SidecarUnavailable(f"the sidecar is shutting down: {err}") from err
            self.registered = previous
            raise
        finally:
            if self.registered is registration:  # taken now, or once a sidecar answers
                self.registrations += 1
                self.hot.grants_lost = True  # the sidecar takes back the session's grant
                self._close_copier()  # it copies the previous registration's tensors
        self._set_up(reply)

    def register_again(self) -> None:
        """Register (again) what `take` last took (grants of the session are
        gone if the sidecar had forgotten it)."""
        reply, _ = self.channel.call(self.register_request())
        self.hot.grants_lost = True
        self._set_up(reply)

    def register_request(self) -> p.Register:
        return self.registration().request(self.session)

    def _set_up(self, reply: r.RegisterReply) -> None:
        """Map the sidecar's shm and open the copier as a Register reply says;
        the heartbeat starts with the first success, which may be a later
        call's re-registration."""
        if reply.boot_id != self.boot_id or self.pool is None:
            self._attach(reply)
        if self.copier is None:
            self._open_copier(reply)
        self.hot.map(reply.hot_index, reply.boot_id)
        self.lease_seconds = reply.lease_seconds
        self.features = frozenset(reply.features)
        self.hot.heard()
        if self.heartbeat is None:
            self.heartbeat = Heartbeat(
                self.endpoint,
                self.timeout,
                self.session,
                lease=lambda: self.lease_seconds,
                register_request=self.register_request,
                heard=self._heard,
                curve=self._curve,
                touch=self.hot.take_touch,
                release=self.hot.take_release,
                rejoined=self._rejoined,
            )

    def _attach(self, reply: r.RegisterReply) -> None:
        """Map the (new) sidecar's segments."""
        self._close_copier()
        self.hot.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        try:
            self.pool = ShmPool.attach(reply.segments, reply.segment_sizes)
        except (OSError, ShmPoolError) as err:  # that sidecar went away since it replied
            raise SidecarUnavailable(f"cannot map the sidecar's shared memory: {err}") from None
        self.boot_id = self.live_boot = reply.boot_id

    def _heard(self, boot_id: str) -> None:
        """The heartbeat's thread heard from the sidecar of `boot_id`."""
        self.live_boot = boot_id
        self.hot.heard()

    def _rejoined(self) -> None:
        """The heartbeat registered the session again: its grants are gone."""
        self.hot.grants_lost = True

    def pool_is_stale(self) -> bool:
        """The heartbeat met a sidecar other than the one whose pool is mapped
        here (it restarted): the next call or plan maps the new pool."""
        return self.live_boot not in (None, self.boot_id)

    def _open_copier(self, reply: r.RegisterReply) -> None:
        """The copier between the registered tensors and the mapped pool."""
        registration = self.registration()
        self.layout = registration.layout
        if self.layout.slot_stride != reply.slot_stride:
            raise SidecarError(
                ErrorCode.LAYOUT_MISMATCH, "the sidecar's slot stride differs from ours"
            )
        assert self.pool is not None
        self.copier = open_copier(registration.planes, self.pool)  # pins the pool once (GPU)

    def _close_copier(self) -> None:
        if self.copier is not None:
            self.copier.close()
            self.copier = None

    def hot_flags(self, enabled: bool) -> int:
        """The hot index's flags while this session may use it (`enabled`),
        else 0: it is mapped for the sidecar whose pool is mapped, that
        sidecar is alive and serving it, and the copier is open."""
        if not enabled or self.copier is None or self.pool_is_stale():
            return 0
        return self.hot.flags(self.timeout)

    def call(self, request: Any, arrays: Sequence[bytes] = ()) -> tuple[Any, list[bytes]]:
        """A request on this session; re-registers once if the sidecar forgot us."""
        self.ready()
        try:
            return self.channel.call(request, arrays)
        except SidecarError as err:
            if err.code is not ErrorCode.NOT_REGISTERED:
                raise
        self.register_again()
        return self.channel.call(request, arrays)

    def ready(self) -> None:
        """Before a request on this session: RuntimeError unless registered;
        the sidecar's pool mapped, registering again if need be."""
        self.registration()
        if self.copier is None or self.pool_is_stale():
            # The last Register got no reply in time (the sidecar may know the
            # session all the same, but the pool is not mapped here yet), or
            # the heartbeat met a restarted sidecar: map its pool now, and
            # unmap the old one, whose RAM this mapping alone keeps.
            self.register_again()

    def close(self) -> None:
        """Unregister (best effort), stop heartbeats, unmap the shm. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.registered is not None:  # kept: its keys can still be computed
            self.hot.send_touch()
            with contextlib.suppress(SidecarUnavailable, SidecarError):
                self.channel.call(self.req(p.Unregister), timeout=min(self.timeout, 0.5))
        self._close_copier()
        self.hot.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.channel.close()

    # ---- plans -------------------------------------------------------------------

    def run(self, plan: PlanOps | None, num_tokens: int) -> TransferHandle:
        """Copy this rank's shard for every op and report them all at once: a
        save's at once (the sidecar may overwrite nothing until the bytes
        are in the slots, so the copy is waited for), a load's once its
        copies have landed (at once for CPU tensors; GPU: `handle.wait()`)."""
        if plan is None:
            return self.handle(None, num_tokens, None)
        copier, layout = self._plan_copier(plan)
        self._run_once(plan.boot_id, plan.plan_id)
        try:
            copies = queue_copies(plan, copier, layout, self.registration().tp_rank)
        except Exception as err:
            self.fail(plan, err)
            raise
        if plan.kind == "load" and not all(copy.query() for copy in copies):
            return self.handle(plan, num_tokens, None, copies)
        return self.handle(plan, num_tokens, self._report(plan, copies))

    def layered(self, plan: PlanOps | None, num_tokens: int) -> LayeredTransfer:
        """`run`, its copies queued layer by layer (`LayeredTransfer.copy_layers`)."""
        if plan is None:
            if self.copier is None:
                raise SidecarUnavailable("not registered with the sidecar yet")
            planes = self.copier.copied_planes
            return LayeredTransfer(
                None,
                num_tokens,
                planes.num_layers,
                planes.layer_splits,
                queue=None,
                finish=lambda copies: self.handle(None, num_tokens, None),
                fail=lambda err: None,
            )
        copier, layout = self._plan_copier(plan)
        self._run_once(plan.boot_id, plan.plan_id)
        planes, tp_rank = copier.copied_planes, self.registration().tp_rank

        def finish(copies: Sequence[Copy]) -> TransferHandle:
            if plan.kind == "load" and not all(copy.query() for copy in copies):
                return self.handle(plan, num_tokens, None, copies)
            return self.handle(plan, num_tokens, self._report(plan, copies))

        return LayeredTransfer(
            plan,
            num_tokens,
            planes.num_layers,
            planes.layer_splits,
            queue=lambda layers: queue_copies(plan, copier, layout, tp_rank, layers),
            finish=finish,
            fail=lambda err: self.fail(plan, err),
        )

    def _run_once(self, boot_id: str, plan_id: int) -> None:
        """ValueError if this rank ran or gave back that plan already (a
        relay that delivered it twice, a retry); else it counts as run."""
        key = (boot_id, plan_id)
        with self._ran_lock:
            if key in self._ran:
                raise ValueError(f"plan {plan_id} was run or given back by this rank already")
            self._ran[key] = None
            if len(self._ran) > MAX_RAN:
                del self._ran[next(iter(self._ran))]

    def _plan_copier(self, plan: PlanOps) -> tuple[BlockCopier, BlockLayout]:
        """The copier and layout to run `plan` with; a restarted sidecar's
        shm mapped first (the heartbeat registered the session with it), and
        SidecarUnavailable if the plan's own sidecar is gone."""
        if plan.boot_id != self.boot_id or self.pool_is_stale():
            self.register_again()
            self.check_boot(plan)
        if self.copier is None or self.layout is None:
            raise SidecarUnavailable("not registered with the sidecar yet")
        return self.copier, self.layout

    def handle(
        self,
        plan: PlanOps | None,
        num_tokens: int,
        ack: int | None,
        copies: Sequence[Copy] = (),
        count: Callable[[Any], int] | None = None,
        parts: Sequence[TransferHandle] = (),
    ) -> TransferHandle:
        return TransferHandle(
            plan,
            num_tokens,
            ack,
            copies,
            report=self._report,
            wait_reply=self.channel.wait_reply,
            count=count,
            parts=parts,
        )

    def _report(self, plan: PlanOps, copies: Sequence[Copy]) -> int:
        """Wait for the copies, then tell the sidecar; the id of its reply."""
        try:
            # The sidecar may reuse the slots once told: the bytes must have landed.
            for copy in copies:
                copy.synchronize()
        except Exception as err:
            self.fail(plan, err)
            raise
        self.check_boot(plan)  # a restart since the copies started: nothing to report to
        op_ids = [op[0] for op in plan.ops]
        return self.channel.send(self.req(p.Complete, plan_id=plan.plan_id, op_ids=op_ids))

    def check_boot(self, plan: PlanOps) -> None:
        """SidecarUnavailable if the sidecar that made `plan` has restarted
        since (seen by this thread, or by the heartbeat): nothing is told a
        sidecar that does not know the plan."""
        if plan.boot_id != self.boot_id or self.live_boot not in (None, plan.boot_id):
            raise SidecarUnavailable(
                f"plan {plan.plan_id} was made by a sidecar that has restarted since"
            )

    def fail(self, plan: PlanOps, err: Exception) -> None:
        self.channel.send(
            self.req(p.Fail, plan_id=plan.plan_id, op_id=plan.ops[0][0], reason=repr(err)),
            reply=False,
        )

    def give_back(self, plan_id: int) -> None:
        """A load or save was answered after this client stopped waiting: no
        copy ran for that plan, so cancel it (its locks and slots go back)."""
        if self.boot_id is not None:
            with contextlib.suppress(ValueError):  # given back twice: told once
                self._run_once(self.boot_id, plan_id)
        with contextlib.suppress(SidecarUnavailable):  # gone, and its plans with it
            self.channel.send(self.req(p.Cancel, plan_id=plan_id), reply=False)


def plan_ops(reply: r.PlanReply, arrays: list[bytes], kind: str) -> PlanOps | None:
    """The engine side of a Load or Save reply: its ops and their id arrays."""
    if not reply.ops:
        return None
    out = []
    for i, op in enumerate(reply.ops):
        src = np.frombuffer(arrays[2 * i], dtype=p.ID_DTYPE)
        dst = np.frombuffer(arrays[2 * i + 1], dtype=p.ID_DTYPE)
        out.append(EngineOp(op.op_id, op.kind, src, dst))
    return PlanOps(reply.plan_id, kind, tuple(out), reply.boot_id)
