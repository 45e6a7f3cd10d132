"""Wire protocol between engine shims (ZeroMQ DEALER) and the sidecar (ROUTER).

A message is one header frame and zero or more array frames:

    request:  [header, *arrays]     header = msgpack map {"v", "id", "op", ...}
    reply:    [header, *arrays]     header = {"v", "id", "ok": true, ...}
    error:    [header]              header = {"v", "id", "ok": false, "code", "message"}

Replies are typed too: `contract.replies`.

Headers are msgpack, decoded with msgspec into one typed struct per op (the
`op` field is the tag), so a missing field or a wrong type is a decode error
that names the field. A request's fields left at their defaults are not
sent: a field added within a protocol version (with a default) reaches an
older sidecar, which refuses unknown fields, only where it is set, and a
client sets it only if the sidecar's register reply names it (`FEATURES`).
Arrays (block keys, slot ids, engine block ids) travel
as raw little-endian frames, never element by element: a 2,048-key request
costs microseconds to encode instead of ~100 µs as a msgpack list.

Array frames per request op: lookup, exists, delete: [keys]; load, save:
[keys, block_ids]. Keys are 16 bytes each; block ids int64. A load or save
reply carries two frames per engine-side op: its source and destination ids.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

from contract.ids import KEY_BYTES, KEY_DTYPE, BlockKeys, key_bytes

PROTOCOL_VERSION = 1
LOAD_END = "load_end"
"""A feature: `Load.end`, loads asked for in parts (engine_shim/parts.py)."""
FEATURES = (LOAD_END,)
"""What this sidecar takes beyond the first version-1 sidecars, named in
its RegisterReply (replies.RegisterReply.features). Requests and replies
of one protocol version only gain fields with defaults; a reply's unknown
fields are ignored, a request's refused."""
MAX_BLOCKS_PER_REQUEST = 1 << 20
ID_DTYPE = np.dtype("<i8")


class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"
    """Not a protocol message: garbage bytes, missing or wrong-typed fields."""
    BAD_VERSION = "bad_version"
    UNKNOWN_OP = "unknown_op"
    BAD_VALUE = "bad_value"
    """Well-formed, but a value is out of range (a block id, a count, a rank)."""
    NOT_REGISTERED = "not_registered"
    """The session is unknown: register (again) first."""
    LAYOUT_MISMATCH = "layout_mismatch"
    UNKNOWN_PLAN = "unknown_plan"
    NOT_OWNER = "not_owner"
    """The plan or op belongs to another engine."""
    BUSY = "busy"
    """The blocks are locked or in flight; try again later."""
    RANKS_MISSING = "ranks_missing"
    """A load or save from an engine some of whose TP ranks are not registered
    (yet, or no longer): its plan could never complete."""
    SHUTTING_DOWN = "shutting_down"
    FORBIDDEN = "forbidden"
    """An administrator's op without the admin token."""
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A request the sidecar refuses; becomes an error reply, changes no state."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---- request headers ------------------------------------------------------------


class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True):
    v: int
    id: int


class _SessionRequest(_Request):
    session: str


class KVLayoutMsg(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What one TP rank's paged KV cache looks like, and which model made it."""

    model_name: str
    model_revision: str
    layout: str
    dtype: str
    tp_size: int
    tp_rank: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    layer_block_bytes: int
    """Bytes of one block of one layer of this rank's KV tensors."""
    num_gpu_blocks: int
    """Blocks in the engine's paged KV cache: valid engine block ids are below it."""
    tenant: str = ""


class Register(_SessionRequest, tag="register"):
    engine_id: str
    """Shared by all TP ranks of one engine instance."""
    kv: KVLayoutMsg
    pid: int = 0
    pid_ns: str = ""
    """The engine's PID namespace (readlink /proc/self/ns/pid): its pid is
    only meaningful to a sidecar in the same one."""


class Lookup(_SessionRequest, tag="lookup"):
    pass


class Exists(_SessionRequest, tag="exists"):
    pass


class Delete(_SessionRequest, tag="delete"):
    pass


class Load(_SessionRequest, tag="load"):
    skip: int = 0
    end: int = 0
    """Copy keys[skip:end] only (0: to the last key): one part of a load
    asked for in parts. Blocks past `end` that must be staged from a lower
    tier are staged all the same, made ready every `end - skip` blocks, so
    that the next part (asked with skip=end) is answered once its own are."""


class Save(_SessionRequest, tag="save"):
    skip: int = 0
    """The first `skip` keys are a prefix the engine holds no bytes for
    (their block ids are placeholders): only blocks past it are stored, and
    only while that whole prefix is ready in the CPU tier."""
    shared_early: bool = False
    """The requester hands the plan to the engine's other TP ranks before it
    reports its own copies (a layer-wise save): if it gives the plan up,
    they may still be copying into its slots."""


class Complete(_SessionRequest, tag="complete"):
    plan_id: int
    op_ids: list[int]


class Fail(_SessionRequest, tag="fail"):
    plan_id: int
    op_id: int
    reason: str = ""


class Cancel(_SessionRequest, tag="cancel"):
    plan_id: int


class Touch(_SessionRequest, tag="touch"):
    """What an engine did without asking (lookups and loads through the hot
    index, engine_shim/hotpath.py), sent in batches and never awaited: the
    hit ratios count the lookups, the eviction policy the loads' hits, and
    a policy that learns from requests (hot index flag OBSERVED) each
    lookup's whole key chain.
    Frames: [lookups: int64 pairs (blocks asked, CPU hit blocks)],
    [keys: each load's prefix from its first block, back to back],
    [keys: each observed lookup's whole chain, back to back]."""

    load_blocks: list[int]
    """Blocks of each load's prefix, in the order of the keys frame."""
    seen_blocks: list[int]
    """Blocks of each observed lookup, in the order of the last frame."""
    load_skip: list[int] = []
    """Per load (none: 0 each), the leading blocks of its prefix the engine
    already had: touched with the rest, not counted as loaded."""


class Grant(_SessionRequest, tag="grant"):
    """Free CPU slots for this engine's next saves (engine_shim/hotpath.py):
    its own until it commits blocks into them, or leaves."""

    want: int


class Commit(_SessionRequest, tag="commit"):
    """Blocks an engine copied into slots granted to it. Frames: [keys: the
    whole chain], [slots: one per key from `first` on]; the keys before
    `first` were ready when the engine looked. `boot_id`: the sidecar boot
    that granted the slots; another boot's commit is refused (its bytes went
    to that boot's segments: a restarted sidecar may have granted the same
    slot numbers to the same session since)."""

    first: int
    boot_id: str


class Release(_SessionRequest, tag="release"):
    """Every slot granted to this engine given back (an idle engine's, that
    copies into none). `boot_id`: the sidecar boot that granted them;
    another boot's release is refused. `abandoned_grant`: the id of a Grant
    whose answer the engine will not read (-1: none): it gets no slots."""

    boot_id: str
    abandoned_grant: int = -1


class Heartbeat(_SessionRequest, tag="heartbeat"):
    pass


class Unregister(_SessionRequest, tag="unregister"):
    pass


class Stats(_Request, tag="stats"):
    pass


class Clear(_Request, tag="clear"):
    """Drop cached blocks (an administrator's `kvsidecar clear`): those of the
    namespaces the non-empty fields select (none: every block), from `tier`
    ("": every tier). Blocks locked by a plan in flight stay."""

    token: str
    """The sidecar's admin token (`InstancePaths.admin_token_path`)."""
    tier: str = ""
    model: str = ""
    revision: str = ""
    tenant: str = ""


Request = (
    Register
    | Lookup
    | Exists
    | Delete
    | Load
    | Save
    | Complete
    | Fail
    | Cancel
    | Touch
    | Grant
    | Commit
    | Release
    | Heartbeat
    | Unregister
    | Stats
    | Clear
)

ARRAY_FRAMES: dict[type, int] = {
    Lookup: 1,
    Exists: 1,
    Delete: 1,
    Load: 2,
    Save: 2,
    Touch: 3,
    Commit: 2,
}
"""Array frames each request op carries; the others carry none."""

_request_decoder = msgspec.msgpack.Decoder(Request)
_any_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


def encode(header: Any) -> bytes:
    """A request or reply struct as msgpack."""
    return _encoder.encode(header)


def decode_request(frames: list[bytes]) -> tuple[Any, list[bytes]]:
    """(typed request, array frames) or ProtocolError; also returns the
    request id when it can be read, for the error reply: see `request_id`."""
    if not frames:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "empty message")
    head, arrays = frames[0], frames[1:]
    try:
        request = _request_decoder.decode(head)
    except Exception as err:  # msgspec errors, and e.g. UnicodeDecodeError for bad str
        raise _explain(head, err) from None
    if request.v != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {request.v} not supported; this sidecar speaks {PROTOCOL_VERSION}",
        )
    want = ARRAY_FRAMES.get(type(request), 0)
    if len(arrays) != want:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"{_op_name(request)} takes {want} array frame(s), got {len(arrays)}",
        )
    return request, arrays


def _explain(head: bytes, err: Exception) -> ProtocolError:
    """Tell a wrong version or an unknown op apart from a malformed header."""
    raw = _loose(head)
    if isinstance(raw, dict):
        if raw.get("v") not in (None, PROTOCOL_VERSION):
            return ProtocolError(
                ErrorCode.BAD_VERSION,
                f"protocol version {raw.get('v')!r} not supported; "
                f"this sidecar speaks {PROTOCOL_VERSION}",
            )
        if isinstance(raw.get("op"), str) and raw["op"] not in OP_NAMES:
            return ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {raw['op']!r}")
    return ProtocolError(ErrorCode.BAD_MESSAGE, f"malformed header: {err}")


def request_id(frames: list[bytes]) -> int:
    """The id of a request, even a malformed one (0 when it cannot be read)."""
    raw = _loose(frames[0]) if frames else None
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def _loose(head: bytes) -> Any:
    try:
        return _any_decoder.decode(head)
    except Exception:  # whatever the bytes are, a loose read never raises
        return None


def _op_name(request: Any) -> str:
    return type(request).__struct_config__.tag  # type: ignore[no-any-return]


OP_NAMES = frozenset(t.__struct_config__.tag for t in Request.__args__)


# ---- arrays -----------------------------------------------------------------------


def keys_frame(keys: BlockKeys) -> bytes:
    return key_bytes(keys)  # a KeyHasher's keys go out as the bytes it made


def num_keys(frame: bytes) -> int:
    """How many block keys a raw keys frame holds, or ProtocolError."""
    n, rest = divmod(len(frame), KEY_BYTES)
    if rest:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"keys frame of {len(frame)} bytes is not 16-byte keys"
        )
    if n > MAX_BLOCKS_PER_REQUEST:
        raise ProtocolError(
            ErrorCode.BAD_VALUE, f"more than {MAX_BLOCKS_PER_REQUEST} blocks in one request"
        )
    return n


def parse_keys(frame: bytes) -> BlockKeys:
    """Block keys from a raw frame, or ProtocolError."""
    num_keys(frame)
    return BlockKeys(np.frombuffer(frame, dtype=KEY_DTYPE))


def ids_frame(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype=ID_DTYPE).tobytes()


def parse_ids(frame: bytes, what: str, count: int, upper: int) -> np.ndarray:
    """`count` int64 ids, each in [0, upper), or ProtocolError."""
    if len(frame) != count * ID_DTYPE.itemsize:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"{what}: expected {count} int64 ids ({count * 8} bytes), got {len(frame)} bytes",
        )
    ids = np.frombuffer(frame, dtype=ID_DTYPE)
    if ids.size and (ids.min() < 0 or ids.max() >= upper):
        raise ProtocolError(ErrorCode.BAD_VALUE, f"{what} out of range [0, {upper})")
    return ids


# ---- sending ------------------------------------------------------------------------

_SNDMORE = int(zmq.SNDMORE)
ZERO_COPY_BYTES = 64 << 10
"""Frames of at least this many bytes are sent in place (pyzmq's own
copy_threshold). Copying a large frame makes libzmq allocate and fill fresh
memory, and first touches of fresh pages run at ~1 GB/s here: one 1 MiB
frame took ~1 ms to send that way against ~45 µs in place (hot loop over
inproc). Measured through a sidecar (two sidecars alternated, 40 rounds,
pre-hashed keys): a 65,536-block load 8.4 -> 6.9 ms and save 8.0 -> 6.2 ms
(1 MiB of keys, 512 KiB id frames); 16,384 blocks and fewer unchanged."""


def send_frames(sock: zmq.Socket[bytes], frames: Sequence[bytes], flags: int = 0) -> None:
    """`sock.send_multipart(frames, flags)`, one message.

    pyzmq's send_multipart combines its flags as IntFlag enums per frame,
    ~2 us a message on the hot path; plain ints here. Small frames are
    copied (cheaper than pyzmq's zero-copy bookkeeping); frames of
    ZERO_COPY_BYTES or more are sent in place, pyzmq holding a reference
    until libzmq is done with them, so they must be immutable (bytes).
    `flags` is an int (0 or zmq.NOBLOCK); as with send_multipart, zmq.Again
    can only come from the first frame, and then nothing was sent."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        more = flags | _SNDMORE if i < last else flags
        sock.send(frame, more, copy=len(frame) < ZERO_COPY_BYTES)
