"""Wire formats between sidecars and the router (msgpack via msgspec).

Events: the sidecar's publisher sends two frames, `[TOPIC, EventBatch]`.
Each batch carries the publisher's epoch (a random id per publisher start)
and a sequence number (1, 2, ... within an epoch), so a subscriber sees a
gap or a restart and asks for a resync.

Resync: a REQ to the publisher's ROUTER endpoint with the single frame
`DUMP_REQUEST` is answered by a `DumpReply`: every ready block run of the
publisher's index, parents first, as of batch `seq` of `epoch`. Anything else
is answered by an `ErrorReply`.

Keys travel as one bytes field of concatenated 16-byte keys.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from contract.ids import KEY_BYTES, BlockKey, split_keys

TOPIC = b"kvsidecar.kv"
DUMP_REQUEST = b"dump"


class Stored(NamedTuple):
    keys: list[BlockKey]
    parent: BlockKey | None


class Removed(NamedTuple):
    keys: list[BlockKey]


class Cleared(NamedTuple):
    pass


RouterEvent = Stored | Removed | Cleared


class WireError(ValueError):
    """A message that is not in the expected format; nothing was applied."""


class StoredMsg(msgspec.Struct, array_like=True, tag="stored"):
    keys: bytes
    parent: bytes | None


class RemovedMsg(msgspec.Struct, array_like=True, tag="removed"):
    keys: bytes


class ClearedMsg(msgspec.Struct, array_like=True, tag="cleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True, tag="batch"):
    epoch: str
    seq: int
    worker_id: int
    dp_rank: int
    events: list[StoredMsg | RemovedMsg | ClearedMsg]


class DumpReply(msgspec.Struct, array_like=True, tag="dump"):
    epoch: str
    seq: int
    """The dump is the state after batch `seq` (0: before any batch)."""
    worker_id: int
    dp_rank: int
    runs: list[StoredMsg]


class ErrorReply(msgspec.Struct, array_like=True, tag="error"):
    message: str


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_reply_decoder: msgspec.msgpack.Decoder[DumpReply | ErrorReply] = msgspec.msgpack.Decoder(
    DumpReply | ErrorReply
)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_batch(payload: bytes) -> EventBatch:
    try:
        return _batch_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"bad event batch: {exc!r}") from None


def decode_reply(payload: bytes) -> DumpReply | ErrorReply:
    try:
        return _reply_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"bad resync reply: {exc!r}") from None


def to_events(msgs: list[StoredMsg | RemovedMsg | ClearedMsg]) -> list[RouterEvent]:
    """Wire events -> router events; WireError on a malformed key field."""
    out: list[RouterEvent] = []
    try:
        for m in msgs:
            if isinstance(m, StoredMsg):
                if m.parent is not None and len(m.parent) != KEY_BYTES:
                    raise ValueError(f"parent key must be {KEY_BYTES} bytes")
                parent = None if m.parent is None else BlockKey(m.parent)
                out.append(Stored(split_keys(m.keys), parent))
            elif isinstance(m, RemovedMsg):
                out.append(Removed(split_keys(m.keys)))
            else:
                out.append(Cleared())
    except ValueError as exc:
        raise WireError(f"bad event: {exc}") from None
    return out
