"""One DEALER socket to the sidecar, with request ids, bounded waits and
fail-fast sends.

`IMMEDIATE` makes a send to a sidecar that is not connected fail at once
instead of queueing, so a down sidecar costs the engine nothing. A reply that
arrives after its request timed out is dropped by id; if it carries a plan
(a load or save the caller gave up on), `on_stray_plan` is told its id so
that the plan can be given back instead of holding slots nobody will use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from contract import protocol as p
from contract import replies as r
from contract.endpoint import CurveClientKeys, apply_curve, curve_client_keys
from contract.protocol import ErrorCode

# Plain ints: zmq's IntFlag members cost ~2 us per operation in a hot loop.
_NOBLOCK, _RCVTIMEO = int(zmq.NOBLOCK), int(zmq.RCVTIMEO)


MAX_TIMEOUT = 3600.0
"""The longest client timeout settings accept (seconds): beyond it a call
waits for ever in effect."""


def timeout_problem(value: object) -> str | None:
    """What is wrong with `value` as a client timeout setting (None: nothing)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_TIMEOUT:
        return None  # (NaN is not)
    return f"timeout must be a number of seconds in (0, {MAX_TIMEOUT}], got {value!r}"


class SidecarUnavailable(ConnectionError):
    """The sidecar is not running, not reachable or did not answer in time."""


class SidecarError(RuntimeError):
    """The sidecar refused a request, for the reason `code` says."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


LATE_SECONDS = 60.0
"""How long a reply to a request given up on is looked for by `drain`."""


class Channel:
    def __init__(
        self, endpoint: str, timeout: float, *, curve: CurveClientKeys | None = None
    ) -> None:
        """`curve`: the keys for a sidecar that requires CURVE; None: those
        that KVSIDECAR_CURVE_SERVER_KEY and KVSIDECAR_CURVE_CLIENT_KEY name,
        if set (`contract.endpoint.curve_client_keys`). A sidecar refusing
        the keys never answers: SidecarUnavailable."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.endpoint = endpoint
        self.timeout = timeout
        curve = curve_client_keys() if curve is None else curve
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        if curve is not None:
            apply_curve(self._sock, curve)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._sock.connect(endpoint)
        self._next_id = 1
        self._first_send = True
        self._rcvtimeo = -1  # the socket's receive timeout (ms) as last set
        self._awaited: dict[int, type[r.Ok]] = {}
        """Request id -> the reply type its request expects."""
        self._early: dict[int, list[bytes]] = {}
        self.on_stray_plan: Callable[[int], None] | None = None
        self.late: dict[int, float] = {}
        """Requests given up on -> until when their reply is looked for by
        `drain` (a client that answers from its hot index may not call)."""

    def send(self, request: Any, arrays: Sequence[bytes] = (), *, reply: bool = True) -> int:
        """Send without waiting; returns the request id to `wait_reply` on.
        With reply=False the answer is dropped when it comes."""
        if self._sock.closed:
            raise RuntimeError("this client is closed")
        rid = self._next_id
        self._next_id += 1
        request.id = rid
        frames = [p.encode(request), *arrays]
        try:
            p.send_frames(self._sock, frames, _NOBLOCK)
        except zmq.Again:
            # A fresh socket may still be connecting: its first send waits for
            # that, up to the timeout. Any later send with no sidecar connected
            # (never up, or gone) fails at once.
            # (Writable by the poll, a send can still find no peer: a
            # connection made and dropped at once, as to an address that
            # refuses it.)
            first, self._first_send = self._first_send, False
            if not first or not self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
                raise SidecarUnavailable(f"no sidecar connected at {self.endpoint}") from None
            try:
                p.send_frames(self._sock, frames, _NOBLOCK)
            except zmq.Again:
                raise SidecarUnavailable(f"no sidecar connected at {self.endpoint}") from None
        self._first_send = False
        if reply:
            self._awaited[rid] = r.REPLY_OF[type(request)]
        return rid

    def wait_reply(self, rid: int, timeout: float | None = None) -> tuple[Any, list[bytes]]:
        """The reply to request `rid`, of the type its request expects
        (`contract.replies.REPLY_OF`), and its array frames; SidecarError if
        the sidecar refused, SidecarUnavailable if no reply came within
        `timeout` seconds or it was malformed."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        sock = self._sock
        try:
            while rid not in self._early:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.late[rid] = time.monotonic() + LATE_SECONDS
                    raise self._no_answer(wait)
                # A blocking receive with a timeout: ~2 us less than
                # Socket.poll, which builds a Poller on every call. Setting
                # the timeout costs ~0.7 us: only when it changed (a call's
                # first wait is the same each time, to the millisecond).
                ms = max(1, int(left * 1000))
                if ms != self._rcvtimeo:
                    sock.setsockopt(_RCVTIMEO, ms)
                    self._rcvtimeo = ms
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    self.late[rid] = time.monotonic() + LATE_SECONDS
                    raise self._no_answer(wait) from None
                self._accept(frames)
            frames = self._early.pop(rid)
            reply_type = self._awaited[rid]
        finally:
            self._awaited.pop(rid, None)
        try:
            reply = r.decode_reply(frames[0], reply_type)
        except ValueError as err:
            raise SidecarUnavailable(f"the sidecar at {self.endpoint}: {err}") from None
        if type(reply) is r.ErrorReply:
            raise SidecarError(reply.code, reply.message)
        return reply, frames[1:]

    def call(
        self, request: Any, arrays: Sequence[bytes] = (), timeout: float | None = None
    ) -> tuple[Any, list[bytes]]:
        return self.wait_reply(self.send(request, arrays), timeout)

    def _no_answer(self, wait: float) -> SidecarUnavailable:
        return SidecarUnavailable(
            f"the sidecar at {self.endpoint} did not answer within {wait:g} s"
        )

    def poll_reply(self, rid: int) -> tuple[Any, list[bytes]] | None:
        """The reply to `rid` if it is here (reading what has come, without
        waiting), else None; raises as `wait_reply` for an error reply."""
        while rid not in self._early:
            try:
                frames = self._sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return None
            self._accept(frames)
        return self.wait_reply(rid)

    def abandon(self, rid: int) -> None:
        """Stop waiting for request `rid`: its reply, here already or to come,
        is dropped as a late one (a plan in it is given back). Nothing to do
        once its reply was taken."""
        if self._awaited.pop(rid, None) is None:
            return
        frames = self._early.pop(rid, None)
        if frames is None:
            self.late[rid] = time.monotonic() + LATE_SECONDS
        else:
            self._accept(frames)

    def drain(self) -> None:
        """Read, without waiting, the replies already here to requests given
        up on (a late plan is handed to `on_stray_plan`, which cancels it)."""
        now = time.monotonic()
        for rid in [rid for rid, until in self.late.items() if until < now]:
            del self.late[rid]
        while self.late:
            try:
                frames = self._sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            self._accept(frames)

    def _accept(self, frames: list[bytes]) -> None:
        """Keep a reply someone waits for; drop anything else."""
        try:
            head: r.ReplyHead = r.decode_as(frames[0], r.ReplyHead)
        except (ValueError, IndexError):
            return  # not from a sidecar we understand
        self.late.pop(head.id, None)
        if head.id in self._awaited:
            self._early[head.id] = frames
        elif head.ok and self.on_stray_plan is not None:
            try:
                stray: r.StrayPlan = r.decode_as(frames[0], r.StrayPlan)
            except ValueError:
                return
            if stray.ops:
                self.on_stray_plan(stray.plan_id)

    def close(self) -> None:
        self._sock.close(0)
