"""Bounds on what a register may claim, checked before anything else.

Every string of a Register is at most MAX_TEXT_BYTES of UTF-8 and every
number within its range below, so no engine can make the sidecar keep a
megabyte model name per session or size anything by 2^62 GPU blocks. A
register outside them is refused with `bad_value`, naming the field and
its bound (not echoing the value), and changes nothing.
"""

from __future__ import annotations

from contract import protocol as p
from contract.protocol import ErrorCode, ProtocolError

MAX_TEXT_BYTES = 256

NUMBER_RANGES: dict[str, tuple[int, int]] = {
    "tp_size": (1, 1024),
    "num_layers": (1, 4096),
    "num_kv_heads": (1, 65536),
    "head_dim": (1, 65536),
    "tokens_per_block": (1, 65536),
    "layer_block_bytes": (1, 2**32),
    "num_gpu_blocks": (1, 2**31),
}
"""KVLayoutMsg field -> its inclusive bounds (tp_rank is checked against tp_size)."""

MAX_PID = 2**31 - 1


def check_register(req: p.Register) -> None:
    """ProtocolError(BAD_VALUE) unless every field of `req` is within bounds."""
    kv = req.kv
    texts = {
        "session": req.session,
        "engine_id": req.engine_id,
        "pid_ns": req.pid_ns,
        "model_name": kv.model_name,
        "model_revision": kv.model_revision,
        "tenant": kv.tenant,
        "layout": kv.layout,
        "dtype": kv.dtype,
    }
    for name, text in texts.items():
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_TEXT_BYTES:
            raise ProtocolError(
                ErrorCode.BAD_VALUE,
                f"{name} is {size} bytes of UTF-8; at most {MAX_TEXT_BYTES} are allowed",
            )
    for name, (low, high) in NUMBER_RANGES.items():
        value = getattr(kv, name)
        if not low <= value <= high:
            raise ProtocolError(
                ErrorCode.BAD_VALUE, f"{name} must be in [{low}, {high}], got {value}"
            )
    if not 0 <= req.pid <= MAX_PID:
        raise ProtocolError(
            ErrorCode.BAD_VALUE, f"pid must be in [0, {MAX_PID}] (0: unknown), got {req.pid}"
        )
