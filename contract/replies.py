"""The sidecar's replies: one typed struct per request op, and the error reply.

A reply header is a msgpack map whose keys are a struct's fields in order:
`v`, `id` and `ok` first, then the op's own fields. An error reply is
`{"v", "id", "ok": false, "code", "message"}` with `code` an `ErrorCode`
value. Each request type has exactly one reply type (`REPLY_OF`); a client
decodes the header as the reply its request expects, and as an `ErrorReply`
when it is not one.
"""

from __future__ import annotations

from typing import Any

import msgspec

from contract import protocol as p
from contract.ops import OpKind
from contract.protocol import PROTOCOL_VERSION, ErrorCode


class Ok(msgspec.Struct, kw_only=True):
    """A request done, with nothing to report (fail, cancel, unregister)."""

    v: int = PROTOCOL_VERSION
    id: int
    ok: bool = True


class ErrorReply(msgspec.Struct, kw_only=True):
    """A request refused; the sidecar changed nothing."""

    v: int = PROTOCOL_VERSION
    id: int
    ok: bool = False
    code: ErrorCode
    message: str


class RegisterReply(Ok, kw_only=True):
    boot_id: str
    """Changes when the sidecar restarts: the shm segments are new ones."""
    segments: list[str]
    segment_sizes: list[int]
    slot_stride: int
    num_slots: int
    lease_seconds: float
    hot_index: str = ""
    """The shm segment of this geometry's hot index (shm/hotindex.py): map it
    read-only to look up and load CPU hits without asking ("": none)."""
    features: list[str] = []
    """Request fields this sidecar takes that an older one of the same
    protocol version refuses (`protocol.FEATURES`): a client uses one only
    if named here, so an engine updated before its host's sidecar keeps
    working."""


class LookupReply(Ok, kw_only=True):
    """Blocks of the request's prefix each tier would serve, and their sum."""

    num_blocks: int
    cpu: int
    ssd: int
    remote: int


class ExistsReply(Ok, kw_only=True):
    exists: bool
    """Every key of the request is cached."""


class DeleteReply(Ok, kw_only=True):
    deleted_blocks: int


class PlanOp(msgspec.Struct):
    """An engine-side op of a plan. Its source and destination ids come as two
    array frames, in the order of the reply's `ops`."""

    op_id: int
    kind: OpKind


class PlanReply(Ok, kw_only=True):
    """A load or save plan; `ops` is empty when the engine has nothing to copy
    (everything was skipped or already done)."""

    plan_id: int
    boot_id: str
    ops: list[PlanOp]


class LoadReply(PlanReply, kw_only=True):
    hit_blocks: int
    cpu: int
    ssd: int
    remote: int


class SaveReply(PlanReply, kw_only=True):
    skipped_blocks: int
    """Already cached: not copied."""
    stored_blocks: int
    in_flight_blocks: int
    """Being saved by another plan right now: not copied again."""


class GrantReply(Ok, kw_only=True):
    """Frame: the slots granted (int64), `count` of them (maybe fewer than
    wanted: none free, or the engine holds its most already)."""

    count: int


class CommitReply(Ok, kw_only=True):
    stored: int
    """Blocks made ready from the engine's slots."""
    dropped: int
    """Blocks whose slots went back free: another engine stored or is
    storing them, the prefix before them is gone, or a quota is full."""
    cached: int = 0
    """Leading blocks of the chain ready in the CPU tier after the commit."""


class CompleteReply(Ok, kw_only=True):
    finished: bool
    """The whole plan is done (its sidecar-side ops too)."""


class HeartbeatReply(Ok, kw_only=True):
    lease_seconds: float
    boot_id: str


class StatsReply(Ok, kw_only=True):
    stats: dict[str, Any]


class ClearReply(Ok, kw_only=True):
    removed: dict[str, int]
    """Tier -> blocks dropped."""
    kept: dict[str, int]
    """Tier -> blocks of the chosen namespaces kept (locked or in flight)."""
    namespaces: int
    """Namespaces the request selected."""


Reply = Ok | ErrorReply
"""Every reply type is an `Ok` or the `ErrorReply`."""

REPLY_OF: dict[type, type[Ok]] = {
    p.Register: RegisterReply,
    p.Touch: Ok,
    p.Grant: GrantReply,
    p.Commit: CommitReply,
    p.Release: Ok,
    p.Lookup: LookupReply,
    p.Exists: ExistsReply,
    p.Delete: DeleteReply,
    p.Load: LoadReply,
    p.Save: SaveReply,
    p.Complete: CompleteReply,
    p.Fail: Ok,
    p.Clear: ClearReply,
    p.Cancel: Ok,
    p.Heartbeat: HeartbeatReply,
    p.Unregister: Ok,
    p.Stats: StatsReply,
}


class ReplyHead(msgspec.Struct):
    """What every reply starts with; the rest of the header is skipped."""

    id: int
    ok: bool


class StrayPlan(msgspec.Struct):
    """The plan a reply nobody waits for may carry (a load or save given up)."""

    plan_id: int = -1
    ops: list[PlanOp] = []


_DECODED: list[type[msgspec.Struct]] = [*REPLY_OF.values(), ErrorReply, ReplyHead, StrayPlan]
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(t) for t in _DECODED
}


def decode_as(header: bytes, reply_type: type[msgspec.Struct]) -> Any:
    """The header decoded as `reply_type`; ValueError if it is not one."""
    try:
        return _decoders[reply_type].decode(header)
    except msgspec.DecodeError as err:  # ValidationError is a DecodeError
        raise ValueError(f"malformed {reply_type.__name__} from the sidecar: {err}") from None


def decode_reply(header: bytes, reply_type: type[Ok]) -> Ok | ErrorReply:
    """The reply `reply_type` or, if the sidecar refused, the ErrorReply;
    ValueError if the header is neither."""
    try:
        reply: Ok = _decoders[reply_type].decode(header)
    except msgspec.DecodeError:
        reply = Ok(id=0, ok=False)
    if reply.ok:
        return reply
    error: ErrorReply = decode_as(header, ErrorReply)
    if error.ok:
        raise ValueError(f"malformed {reply_type.__name__} from the sidecar: {header!r}")
    return error


def error(request_id: int, code: ErrorCode, message: str) -> ErrorReply:
    return ErrorReply(id=request_id, code=code, message=message)
