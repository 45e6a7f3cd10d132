"""contract.replies: typed replies, their exact wire maps, and decoding them
as the reply a request expects or as the error reply."""

from __future__ import annotations

import msgspec
import pytest

from contract import protocol as p
from contract import replies as r
from contract.ops import OpKind
from contract.protocol import ErrorCode

V = p.PROTOCOL_VERSION


def test_a_reply_is_the_documented_map_in_field_order():
    """The wire bytes are those of the maps the protocol documents: v, id, ok
    first, then the op's fields in order (engines of an older shim read them)."""
    load = r.LoadReply(
        id=3,
        plan_id=9,
        boot_id="b",
        ops=[r.PlanOp(1, OpKind.H2D)],
        hit_blocks=2,
        cpu=1,
        ssd=1,
        remote=0,
    )
    expected = {
        "v": V, "id": 3, "ok": True, "plan_id": 9, "boot_id": "b",
        "ops": [{"op_id": 1, "kind": "H2D"}], "hit_blocks": 2, "cpu": 1, "ssd": 1, "remote": 0,
    }  # fmt: skip
    assert p.encode(load) == msgspec.msgpack.encode(expected)
    error = r.error(4, ErrorCode.BUSY, "locked")
    assert p.encode(error) == msgspec.msgpack.encode(
        {"v": V, "id": 4, "ok": False, "code": "busy", "message": "locked"}
    )
    assert p.encode(r.Ok(id=5)) == msgspec.msgpack.encode({"v": V, "id": 5, "ok": True})


def test_every_request_type_has_one_reply_type():
    assert set(r.REPLY_OF) == set(p.Request.__args__)  # type: ignore[attr-defined]


def test_a_reply_decodes_as_the_type_its_request_expects():
    lookup = r.LookupReply(id=1, num_blocks=3, cpu=2, ssd=1, remote=0)
    assert r.decode_reply(p.encode(lookup), r.LookupReply) == lookup
    save = r.SaveReply(
        id=2, plan_id=7, boot_id="x", ops=[r.PlanOp(0, OpKind.D2H)],
        skipped_blocks=1, stored_blocks=2, in_flight_blocks=0,
    )  # fmt: skip
    decoded = r.decode_reply(p.encode(save), r.SaveReply)
    assert decoded == save and decoded.ops[0].kind is OpKind.D2H


def test_an_error_decodes_as_the_error_reply_whatever_was_expected():
    header = p.encode(r.error(4, ErrorCode.NOT_REGISTERED, "who?"))
    for expected in (r.Ok, r.LookupReply, r.LoadReply, r.StatsReply):
        reply = r.decode_reply(header, expected)
        assert type(reply) is r.ErrorReply
        assert reply.code is ErrorCode.NOT_REGISTERED and reply.message == "who?"


@pytest.mark.parametrize(
    "header",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"id": 1}),  # no ok
        msgspec.msgpack.encode({"v": V, "id": 1, "ok": True}),  # a lookup reply without counts
        msgspec.msgpack.encode({"v": V, "id": 1, "ok": False, "code": "nope", "message": ""}),
    ],
)
def test_a_malformed_reply_is_a_value_error(header):
    with pytest.raises(ValueError):
        r.decode_reply(header, r.LookupReply)


def test_a_stray_reply_names_its_plan_only_if_it_has_ops():
    save = r.SaveReply(
        id=2, plan_id=7, boot_id="x", ops=[r.PlanOp(0, OpKind.D2H)],
        skipped_blocks=0, stored_blocks=1, in_flight_blocks=0,
    )  # fmt: skip
    stray = r.decode_as(p.encode(save), r.StrayPlan)
    assert stray.plan_id == 7 and stray.ops
    assert not r.decode_as(p.encode(r.Ok(id=1)), r.StrayPlan).ops


def test_register_replies_of_older_and_newer_sidecars_decode_and_name_their_features():
    """A sidecar from before `features` leaves it out: decoded, none named (so
    the client asks nothing an older sidecar refuses). A newer one may send
    fields this shim does not know: ignored."""
    base = {
        "v": V, "id": 1, "ok": True, "boot_id": "b", "segments": ["s"],
        "segment_sizes": [4096], "slot_stride": 64, "num_slots": 8, "lease_seconds": 5.0,
    }  # fmt: skip
    older = r.decode_reply(msgspec.msgpack.encode(base), r.RegisterReply)
    assert isinstance(older, r.RegisterReply) and older.features == []
    newer = {**base, "features": [p.LOAD_END, "later"], "a_later_field": 1}
    reply = r.decode_reply(msgspec.msgpack.encode(newer), r.RegisterReply)
    assert isinstance(reply, r.RegisterReply) and reply.features == [p.LOAD_END, "later"]


def test_a_whole_load_reaches_a_sidecar_from_before_end_and_a_part_is_refused():
    """A request's default fields are not sent, so an older sidecar (its Load
    rebuilt here without `end`; requests refuse unknown fields) takes a whole
    load from a newer client; a part names `end`, hence the feature."""

    class OldLoad(msgspec.Struct, tag_field="op", tag="load", forbid_unknown_fields=True):
        v: int
        id: int
        session: str
        skip: int = 0

    old = msgspec.msgpack.Decoder(OldLoad)
    assert old.decode(p.encode(p.Load(v=V, id=1, session="s", skip=2))) == OldLoad(V, 1, "s", 2)
    with pytest.raises(msgspec.ValidationError, match="end"):
        old.decode(p.encode(p.Load(v=V, id=1, session="s", skip=2, end=3)))
