"""vLLM's KV events (both its array and its map encodings) over a real ZMQ PUB."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from contract.events import Cleared, Removed, Stored, WireError
from router.keys import vllm_key, worker
from router.router import Router
from router.subscriber import Source, Subscriptions
from router.vllm_events import decode_vllm
from tests.helpers import wait_subscribed, wait_until


# The structs of vllm/distributed/kv_events.py, re-declared for the wire format:
# older vLLM encodes them as arrays (int hashes), newer as maps (bytes hashes).
class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(ArrayEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(ArrayEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(ArrayEvent):
    pass


class MapBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, tag_field="type"):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


def frames(seq: int, batch: msgspec.Struct) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def test_array_encoding_decodes_to_router_events() -> None:
    batch = ArrayBatch(
        1.0,
        [
            BlockStored([11, 12], None, list(range(32)), 16, None),
            BlockStored([13], 12, list(range(16)), 16, None, "GPU"),
            BlockStored([99], None, [], 16, None, "CPU"),  # another medium: skipped
            BlockRemoved([13]),
            AllBlocksCleared(),
        ],
        2,
    )
    got = decode_vllm(frames(5, batch))
    assert got.seq == 5 and got.dp_rank == 2
    assert got.events == [
        Stored([vllm_key(11), vllm_key(12)], None),
        Stored([vllm_key(13)], vllm_key(12)),
        Removed([vllm_key(13)]),
        Cleared(),
    ]
    no_rank = decode_vllm(frames(0, ArrayBatch(1.0, [AllBlocksCleared()])))
    assert no_rank.dp_rank == 0 and no_rank.events == [Cleared()]


def test_map_encoding_with_bytes_hashes() -> None:
    h = [bytes([i]) * 32 for i in range(3)]
    batch = MapBatch(
        2.0,
        [
            MapStored(h[:2], None, [], 16, None, "GPU", None),
            MapStored([h[2]], h[1], [], 16, None, "GPU", None, group_idx=1),  # skipped
            MapRemoved([h[1]], "GPU"),
        ],
    )
    got = decode_vllm(frames(0, batch))
    assert got.events == [Stored([vllm_key(h[0]), vllm_key(h[1])], None), Removed([vllm_key(h[1])])]
    assert vllm_key(1) != vllm_key(b"\x01") and vllm_key(7) == vllm_key(7)


@pytest.mark.parametrize(
    "bad",
    [
        [b"topic", b"short", b""],
        [b"topic", bytes(8), b"\xc1"],
        [b"topic", bytes(8), msgspec.msgpack.encode([1.0])],
        [b"topic", bytes(8), msgspec.msgpack.encode([1.0, [["Nope", []]]])],
        [b"topic", bytes(8), msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]])],
        [b"topic", bytes(8), msgspec.msgpack.encode([1.0, [["BlockRemoved", [1.5]]]])],
        [b"topic", bytes(8), msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "X"}]})],
    ],
)
def test_malformed_messages_are_rejected(bad: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode_vllm(bad)


def test_subscriber_indexes_a_vllm_engine_and_clears_on_a_gap(tmp_path) -> None:
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/pub"  # under pytest's tmp_path: removed with it
    pub = ctx.socket(zmq.XPUB)  # a PUB that tells when the router's SUB has subscribed
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    router = Router("flat")
    subs = Subscriptions(ctx, router, [Source(endpoint, vllm_worker_id=7)])
    w = worker(7, 0)
    try:
        stored = ArrayBatch(0.0, [BlockStored([1, 2, 3], None, [], 16, None)])
        wait_subscribed(pub)  # (PUB sends nobody is subscribed to are lost)
        pub.send_multipart(frames(0, stored))
        wait_until(lambda: w in router.index.workers(), subs)
        assert router.find_matches([vllm_key(i) for i in (1, 2, 3)]).scores == {w: 3}
        pub.send_multipart([b"", bytes(8), b"garbage"])
        more = ArrayBatch(0.0, [BlockStored([4], 3, [], 16, None)])
        pub.send_multipart(frames(1, more))
        wait_until(lambda: router.index.workers()[w] == 4, subs)
        assert subs.counts["bad_messages"] == 1
        # seq 2 is lost: the worker is cleared; a store continuing a lost block is skipped.
        gap = ArrayBatch(
            0.0, [BlockStored([5], 4, [], 16, None), BlockStored([8], None, [], 16, None)]
        )
        pub.send_multipart(frames(3, gap))
        wait_until(lambda: subs.counts["gaps"] == 1, subs)
        assert router.index.workers() == {w: 1}
        assert subs.counts["rejected_events"] == 1
    finally:
        subs.close()
        pub.close(0)
        ctx.term()


def test_a_vllm_restart_at_the_same_seq_clears_the_worker(tmp_path) -> None:
    """vLLM numbers batches from 0 at every start: a batch with the seq just
    seen is a restart (PUB/SUB never repeats a message), not a duplicate."""
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/pub"
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    router = Router("radix")
    subs = Subscriptions(ctx, router, [Source(endpoint, vllm_worker_id=7)])
    w = worker(7, 0)
    try:
        wait_subscribed(pub)
        pub.send_multipart(frames(0, ArrayBatch(0.0, [BlockStored([1], None, [], 16, None)])))
        pub.send_multipart(frames(0, ArrayBatch(0.0, [BlockStored([2], None, [], 16, None)])))
        wait_until(lambda: subs.counts["batches"] == 2, subs)
        assert router.find_matches([vllm_key(1)]).scores == {}
        assert router.find_matches([vllm_key(2)]).scores == {w: 1}
        assert subs.counts["gaps"] == 1
    finally:
        subs.close()
        pub.close(0)
        ctx.term()


def test_a_gap_clears_its_rank_and_all_blocks_cleared_every_rank(tmp_path) -> None:
    """vLLM publishes each data-parallel rank on its own port, one source per
    rank of worker 7. A gap on rank 1's stream loses rank 1's blocks alone;
    an AllBlocksCleared from rank 0 clears every rank of the worker (as in
    Dynamo)."""
    ctx = zmq.Context()
    pubs = []
    for r in range(2):
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"ipc://{tmp_path}/pub{r}")
        pubs.append(pub)
    router = Router("radix")
    sources = [Source(f"ipc://{tmp_path}/pub{r}", vllm_worker_id=7) for r in range(2)]
    subs = Subscriptions(ctx, router, sources)
    ranks = [worker(7, 0), worker(7, 1)]
    try:
        for r, pub in enumerate(pubs):
            wait_subscribed(pub)
            batch = ArrayBatch(0.0, [BlockStored([1, 2], None, [], 16, None)], r)
            pub.send_multipart(frames(0, batch))
        wait_until(lambda: router.index.workers() == dict.fromkeys(ranks, 2), subs)
        pubs[1].send_multipart(frames(2, ArrayBatch(0.0, [], 1)))  # seq 1 lost
        wait_until(lambda: subs.counts["gaps"] == 1, subs)
        assert router.index.workers() == {ranks[0]: 2, ranks[1]: 0}
        pubs[0].send_multipart(frames(1, ArrayBatch(0.0, [AllBlocksCleared()], 0)))
        wait_until(lambda: subs.counts["batches"] == 4, subs)
        assert router.index.workers() == dict.fromkeys(ranks, 0)
    finally:
        subs.close()
        for pub in pubs:
            pub.close(0)
        ctx.term()
