"""Header and array encodings of the wire protocol: msgpack vs msgspec.

Called by `kvsidecar bench control`. Each figure is the median µs of one
encode plus one decode of the same value, in this process:
- request headers (a Lookup, a Load with a field, a Complete with op ids) as
  the typed msgspec Structs of `contract.protocol` (what the sidecar decodes),
  as plain dicts through msgspec, and as plain dicts through the msgpack
  package;
- 2,048 block keys as one raw frame (`protocol.keys_frame` / `parse_keys`,
  the floor) and as a msgpack list of ints (two uint64 halves per 16-byte
  key), through msgpack and msgspec, including the conversion from and back
  to the numpy key array the sidecar works on.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec
import numpy as np

from contract import protocol as p

HEADER_CODECS = ("msgspec_struct", "msgspec_dict", "msgpack_dict")
KEYS_FORMATS = ("raw_frame", "msgpack_list", "msgspec_list")
NUM_KEYS = 2048


def typical_requests() -> dict[str, Any]:
    session = uuid.uuid4().hex
    v = p.PROTOCOL_VERSION
    return {
        "lookup": p.Lookup(v=v, id=1234, session=session),
        "load": p.Load(v=v, id=1235, session=session, skip=4),
        "complete": p.Complete(v=v, id=1236, session=session, plan_id=77, op_ids=[0, 1, 2]),
    }


def per_call_us(fn: Callable[[], object], budget_s: float, rounds: int = 5) -> float:
    """Median over `rounds` of the mean µs per call, each round ~budget_s / rounds."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    number = max(10, int(budget_s / rounds / max(once, 1e-7)))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times) * 1e6


def measure_codecs(budget_s: float = 0.1) -> dict[str, Any]:
    """encode_us[codec][message], header_bytes[message], keys_encode_us[format],
    keys_bytes[format]; `budget_s` of timing per figure."""
    typed = msgspec.msgpack.Decoder(p.Request)  # type: ignore[arg-type]
    encode_us: dict[str, dict[str, float]] = {codec: {} for codec in HEADER_CODECS}
    header_bytes = {}
    for name, request in typical_requests().items():
        plain = msgspec.to_builtins(request)  # a dict, with the "op" tag
        assert typed.decode(msgpack.packb(plain)) == request  # the encodings agree
        header_bytes[name] = len(p.encode(request))
        encode_us["msgspec_struct"][name] = per_call_us(
            lambda r=request: typed.decode(p.encode(r)), budget_s
        )
        encode_us["msgspec_dict"][name] = per_call_us(
            lambda d=plain: msgspec.msgpack.decode(msgspec.msgpack.encode(d)), budget_s
        )
        encode_us["msgpack_dict"][name] = per_call_us(
            lambda d=plain: msgpack.unpackb(msgpack.packb(d)), budget_s
        )

    keys = p.parse_keys(np.random.default_rng(0).bytes(NUM_KEYS * p.KEY_DTYPE.itemsize))

    def as_ints(k: np.ndarray) -> list[int]:
        return k.view("<u8").tolist()  # type: ignore[no-any-return]

    def from_ints(ints: list[int]) -> np.ndarray:
        return np.array(ints, dtype="<u8").view(p.KEY_DTYPE)

    codecs: dict[str, tuple[Callable[[np.ndarray], bytes], Callable[[bytes], np.ndarray]]] = {
        "raw_frame": (p.keys_frame, p.parse_keys),
        "msgpack_list": (
            lambda k: msgpack.packb(as_ints(k)),
            lambda b: from_ints(msgpack.unpackb(b)),
        ),
        "msgspec_list": (
            lambda k: msgspec.msgpack.encode(as_ints(k)),
            lambda b: from_ints(msgspec.msgpack.decode(b)),
        ),
    }
    keys_us, keys_bytes = {}, {}
    for fmt, (enc, dec) in codecs.items():
        assert dec(enc(keys)).tobytes() == keys.tobytes()
        keys_bytes[fmt] = len(enc(keys))
        keys_us[fmt] = per_call_us(lambda e=enc, d=dec: d(e(keys)), budget_s)
    return {
        "encode_us": encode_us,
        "header_bytes": header_bytes,
        "keys_encode_us": keys_us,
        "keys_bytes": keys_bytes,
        "keys_list_vs_raw": {fmt: keys_us[fmt] / keys_us["raw_frame"] for fmt in KEYS_FORMATS[1:]},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(measure_codecs(), indent=2))
