"""contract.protocol: typed decoding, raw array frames, structured errors."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from helpers import chain, key_ids

from contract import protocol as p
from contract.blocks import KeyHasher, Namespace
from contract.protocol import ErrorCode, ProtocolError

V = p.PROTOCOL_VERSION


def raw(header: object, *arrays: bytes) -> list[bytes]:
    return [msgspec.msgpack.encode(header), *arrays]


def code_of(frames: list[bytes]) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        p.decode_request(frames)
    return info.value.code


def test_a_request_round_trips_with_its_arrays():
    keys = chain(3)
    frames = [p.encode(p.Load(v=V, id=7, session="s", skip=1)), p.keys_frame(keys), b"x" * 24]
    request, arrays = p.decode_request(frames)
    assert isinstance(request, p.Load) and (request.id, request.skip) == (7, 1)
    assert p.parse_keys(arrays[0]).tobytes() == keys.tobytes()


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([], ErrorCode.BAD_MESSAGE),
        ([b"\xc1garbage"], ErrorCode.BAD_MESSAGE),
        (raw([1, 2, 3]), ErrorCode.BAD_MESSAGE),
        (raw({"v": V, "id": 1}), ErrorCode.BAD_MESSAGE),  # no op
        (raw({"v": V, "id": 1, "op": "frobnicate"}), ErrorCode.UNKNOWN_OP),
        (raw({"v": 99, "id": 1, "op": "stats"}), ErrorCode.BAD_VERSION),
        (raw({"v": V, "id": 1, "op": "lookup"}, b""), ErrorCode.BAD_MESSAGE),  # no session
        (raw({"v": V, "id": "1", "op": "stats"}), ErrorCode.BAD_MESSAGE),  # wrong type
        (raw({"v": V, "id": 1, "op": "stats", "extra": 1}), ErrorCode.BAD_MESSAGE),
        (raw({"v": V, "id": 1, "op": "lookup", "session": "s"}), ErrorCode.BAD_MESSAGE),
        (raw({"v": V, "id": 1, "op": "stats"}, b"unexpected"), ErrorCode.BAD_MESSAGE),
    ],
)
def test_malformed_requests_get_a_precise_code(frames, code):
    assert code_of(frames) == code


def test_the_id_of_a_malformed_request_is_still_read_for_the_reply():
    assert p.request_id(raw({"v": V, "id": 41, "op": "nope"})) == 41
    assert p.request_id([b"\x00\x01garbage"]) == 0
    assert p.request_id([]) == 0


def test_a_key_frame_is_the_bytes_the_keys_view_or_else_a_copy_in_their_order():
    ns = Namespace("m", "r", "paged", "float32", 1, 1, 1, 8, 16)
    hashed = KeyHasher(ns).hash_tokens(np.arange(64))
    frame = p.keys_frame(hashed)
    assert frame is hashed.base  # the hasher's own bytes, not a copy
    assert p.parse_keys(frame).tobytes() == hashed.tobytes()
    whole = chain(6)
    for view in (whole[::-1], whole[1:4], whole[::2]):  # not all of, or not in order
        assert p.keys_frame(view) == view.tobytes()
        assert key_ids(p.keys_frame(view)) == key_ids(view.tobytes())
    from_frame = p.parse_keys(whole.tobytes())
    assert p.keys_frame(from_frame[::-1]) == from_frame[::-1].tobytes()  # views a whole bytes
    assert key_ids(p.keys_frame(from_frame[::-1])) == [6, 5, 4, 3, 2, 1]


def test_a_keys_frame_is_counted_or_refused():
    assert p.num_keys(b"") == 0 and p.num_keys(bytes(16 * 3)) == 3
    with pytest.raises(ProtocolError) as info:
        p.num_keys(b"x" * 17)
    assert info.value.code == ErrorCode.BAD_MESSAGE
    with pytest.raises(ProtocolError) as info:
        p.num_keys(bytes(16 * (p.MAX_BLOCKS_PER_REQUEST + 1)))
    assert info.value.code == ErrorCode.BAD_VALUE


def test_key_and_id_frames_are_checked():
    with pytest.raises(ProtocolError, match="16-byte"):
        p.parse_keys(b"x" * 17)
    ids = np.array([0, 5, 9])
    assert p.parse_ids(p.ids_frame(ids), "block_ids", 3, 10).tolist() == [0, 5, 9]
    with pytest.raises(ProtocolError) as info:
        p.parse_ids(p.ids_frame(ids), "block_ids", 3, 9)
    assert info.value.code == ErrorCode.BAD_VALUE
    with pytest.raises(ProtocolError) as info:
        p.parse_ids(p.ids_frame(ids), "block_ids", 2, 10)
    assert info.value.code == ErrorCode.BAD_MESSAGE
    with pytest.raises(ProtocolError):
        p.parse_ids(p.ids_frame(np.array([-1])), "block_ids", 1, 10)
