"""vLLM's own KV events, for engines indexed without a sidecar.

vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py) sends three frames,
`[topic, seq, payload]`: `seq` an 8-byte big-endian counter from 0, `payload`
a msgpack `EventBatch`. Older vLLM encodes structs as arrays:
`[ts, [event, ...]]` or `[ts, [event, ...], dp_rank]`, each event a tagged
array, `["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, ...]`, `["BlockRemoved", block_hashes, ...]`,
`["AllBlocksCleared"]`. Newer vLLM encodes the same structs as maps
(`{"ts", "events", "data_parallel_rank"}`, events tagged by `"type"`). Both
are accepted. Block hashes are ints (older) or bytes (newer); `vllm_key`
maps them into router keys.

Events for another medium than the GPU (a vLLM CPU offload) or another KV
cache group than 0 are skipped: the router indexes what the engine serves.
A BlockStored also carries its blocks' token ids, block size and LoRA id
(`StoredTokens`, alongside the event): `router.vllm_tokens` keys blocks by
their tokens with them, as Dynamo does, so a proxy can match prompts it
tokenized itself against them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from contract.events import Cleared, Removed, RouterEvent, Stored, WireError
from router.keys import vllm_key, vllm_keys

_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}

# Positions of the optional trailing fields in the array encoding.
_ARRAY_EXTRAS = {
    "BlockStored": (
        ("token_ids", 3),
        ("block_size", 4),
        ("lora_id", 5),
        ("medium", 6),
        ("group_idx", 9),
    ),
    "BlockRemoved": (("medium", 2), ("group_idx", 3)),
}


class StoredTokens(NamedTuple):
    token_ids: list[int]
    """The tokens of the stored blocks, concatenated."""
    block_size: int
    lora_id: int | None


class VllmBatch(NamedTuple):
    seq: int
    dp_rank: int
    events: list[RouterEvent]
    tokens: list[StoredTokens | None]
    """Per event: its tokens for a BlockStored that carries them, else None."""


def decode_vllm(frames: list[bytes]) -> VllmBatch:
    """Decode one vLLM event message; WireError if it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError("a vLLM event message is 3 frames: topic, 8-byte seq, payload")
    seq = int.from_bytes(frames[1], "big")
    try:
        batch = msgspec.msgpack.decode(frames[2])
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise WireError(f"vLLM event payload is not msgpack: {exc!r}") from None
    if isinstance(batch, dict):
        raw_events, dp_rank = batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) in (2, 3):
        raw_events, dp_rank = batch[1], batch[2] if len(batch) == 3 else None
    else:
        raise WireError("a vLLM EventBatch is [ts, events(, dp_rank)] or a map")
    if not isinstance(raw_events, list):
        raise WireError("EventBatch.events must be a list")
    if dp_rank is not None and (not isinstance(dp_rank, int) or dp_rank < 0):
        raise WireError(f"bad data_parallel_rank {dp_rank!r}")
    events: list[RouterEvent] = []
    tokens: list[StoredTokens | None] = []
    try:
        for raw in raw_events:
            decoded = _event(raw)
            if decoded is not None:
                events.append(decoded[0])
                tokens.append(decoded[1])
    except (ValueError, TypeError) as exc:
        raise WireError(f"bad vLLM event: {exc}") from None
    return VllmBatch(seq, dp_rank or 0, events, tokens)


def _event(raw: Any) -> tuple[RouterEvent, StoredTokens | None] | None:
    tag, fields = _tag_and_fields(raw)
    if fields.get("medium") not in (None, "GPU") or fields.get("group_idx") not in (None, 0):
        return None
    if tag == "AllBlocksCleared":
        return Cleared(), None
    hashes = fields["block_hashes"]
    if not isinstance(hashes, list):
        raise ValueError("block_hashes must be a list")
    if tag == "BlockRemoved":
        return Removed(vllm_keys(hashes)), None
    parent = fields["parent_block_hash"]
    stored = Stored(vllm_keys(hashes), None if parent is None else vllm_key(parent))
    return stored, _stored_tokens(fields)


def _stored_tokens(fields: dict[str, Any]) -> StoredTokens | None:
    """The tokens a BlockStored carries, or None if it carries none usable."""
    ids, size, lora = fields.get("token_ids"), fields.get("block_size"), fields.get("lora_id")
    if not isinstance(ids, list) or isinstance(size, bool) or not isinstance(size, int):
        return None
    if size <= 0 or not all(type(t) is int for t in ids):
        raise ValueError("BlockStored token_ids must be ints and block_size > 0")
    if lora is not None and (isinstance(lora, bool) or not isinstance(lora, int)):
        raise ValueError(f"bad lora_id {lora!r}")
    return StoredTokens(ids, size, lora)


def _tag_and_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if tag not in _FIELDS:
            raise ValueError(f"unknown event type {tag!r}")
        missing = [f for f in _FIELDS[tag] if f not in raw]
        if missing:
            raise ValueError(f"{tag} lacks {', '.join(missing)}")
        return tag, raw
    if isinstance(raw, list) and raw and raw[0] in _FIELDS:
        tag = raw[0]
        names = _FIELDS[tag]
        if len(raw) < 1 + len(names):
            raise ValueError(f"{tag} has {len(raw) - 1} fields, needs at least {len(names)}")
        fields = dict(zip(names, raw[1:], strict=False))
        for name, pos in _ARRAY_EXTRAS.get(tag, ()):
            if len(raw) > pos:
                fields[name] = raw[pos]
        return tag, fields
    raise ValueError(f"not a tagged vLLM event: {raw!r:.80}")
