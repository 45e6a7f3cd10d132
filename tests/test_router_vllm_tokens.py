"""vLLM's blocks keyed by their tokens (router/vllm_tokens.py): decoded from
both encodings, and followed over a real ZMQ PUB by the subscriber."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from contract.blocks import KeyHasher, Namespace
from router.keys import split_keys, worker
from router.router import Router
from router.subscriber import Source, Subscriptions
from router.vllm_events import StoredTokens, decode_vllm
from router.vllm_tokens import TokenKeyer
from tests.helpers import wait_subscribed, wait_until
from tests.test_router_vllm import (
    AllBlocksCleared,
    ArrayBatch,
    BlockRemoved,
    BlockStored,
    MapBatch,
    MapStored,
    frames,
)

HASHER = KeyHasher(Namespace("m", "vllm-events", "vllm", "any", 1, 1, 1, 1, 16))
W0, W0R1 = worker(5), worker(5, 1)


def token_keys(tokens: list[int]) -> list:
    return split_keys(HASHER.hash_tokens(np.asarray(tokens, dtype=np.int64)).tobytes())


def test_both_encodings_carry_the_tokens() -> None:
    toks = list(range(32))
    array = decode_vllm(frames(0, ArrayBatch(1.0, [BlockStored([1, 2], None, toks, 16, None)])))
    stored = MapStored([b"a" * 32], None, toks[:16], 16, 3, "GPU", "adapter")
    mapped = decode_vllm(frames(1, MapBatch(1.0, [stored])))
    assert array.tokens == [StoredTokens(toks, 16, None)]
    assert mapped.tokens == [StoredTokens(toks[:16], 16, 3)]
    removed = decode_vllm(frames(2, ArrayBatch(1.0, [BlockRemoved([1])])))
    assert removed.tokens == [None]


def test_a_prompt_matches_what_vllm_stored_in_pieces() -> None:
    """Blocks stored in two events (the second continuing the first by
    vLLM's hash) match the prompt's token keys; removals by vLLM hash and a
    clear from another rank follow."""
    router, keyer = Router(), TokenKeyer(HASHER)
    toks = list(range(100, 164))  # 4 blocks
    events = decode_vllm(
        frames(
            0,
            ArrayBatch(
                1.0,
                [
                    BlockStored([7, 8], None, toks[:32], 16, None),
                    BlockStored([9, 10], 8, toks[32:], 16, None),
                    BlockStored([11], 99, toks[:16], 16, None),  # unknown parent: refused
                    BlockStored([12], None, toks[:8], 16, None),  # half a block: refused
                ],
            ),
        )
    )
    applied = 0
    for event, tokens in zip(events.events, events.tokens, strict=True):
        try:
            keyed = keyer.translate(W0, event, tokens)
        except ValueError:
            continue
        router.apply(W0, [keyed])
        keyer.commit(W0, event, keyed)
        applied += 1
    assert applied == 2
    assert router.find_matches(token_keys(toks)).scores == {W0: 4}
    removed = decode_vllm(frames(1, ArrayBatch(1.0, [BlockRemoved([9])])))
    keyed = keyer.translate(W0, removed.events[0], None)
    router.apply(W0, [keyed])
    keyer.commit(W0, removed.events[0], keyed)
    assert router.find_matches(token_keys(toks)).scores == {W0: 2}
    cleared = decode_vllm(frames(2, ArrayBatch(1.0, [AllBlocksCleared()], 1)))
    keyed = keyer.translate(W0R1, cleared.events[0], None)
    router.apply(W0R1, [keyed])
    keyer.commit(W0R1, cleared.events[0], keyed)
    assert router.find_matches(token_keys(toks)).scores == {}
    assert keyer.blocks() == 0


@pytest.fixture
def vllm_feed() -> Iterator[tuple[zmq.Socket, Router, Subscriptions]]:
    """A publisher standing in for vLLM, and a router subscribed to it that
    keys its blocks by their tokens."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    router = Router()
    subs = Subscriptions(ctx, router, [Source(endpoint, None, 5)], token_keys=TokenKeyer(HASHER))
    try:
        wait_subscribed(pub)
        yield pub, router, subs
    finally:
        subs.close()
        pub.close(0)
        ctx.term()


def test_the_subscriber_keys_vllm_events_by_tokens(vllm_feed) -> None:
    pub, router, subs = vllm_feed
    toks = list(range(48))
    batch = ArrayBatch(
        1.0,
        [
            BlockStored([1, 2, 3], None, toks, 16, None),
            BlockStored([4], 3, toks[:16], 16, 7),  # a LoRA's block: not keyed
        ],
    )
    pub.send_multipart(frames(0, batch))
    wait_until(lambda: subs.counts["events"] == 1, subs)
    assert subs.counts["untokenized_events"] == 1
    assert router.find_matches(token_keys([*toks, *range(16)])).scores == {W0: 3}
    pub.send_multipart(frames(5, ArrayBatch(1.0, [BlockRemoved([1])])))  # a gap
    wait_until(lambda: subs.counts["gaps"] == 1, subs)
    assert router.find_matches(token_keys(toks)).scores == {}
    assert subs.token_keys is not None and subs.token_keys.blocks() == 0


def test_a_store_whose_token_ids_cannot_be_hashed_is_skipped_and_the_batch_goes_on(
    vllm_feed,
) -> None:
    """Before, its error dropped the rest of the batch (here the removal)
    with the sequence counted: the removed block stayed matched."""
    pub, router, subs = vllm_feed
    toks = list(range(16))
    pub.send_multipart(frames(0, ArrayBatch(1.0, [BlockStored([1], None, toks, 16, None)])))
    wait_until(lambda: subs.counts["events"] == 1, subs)
    assert router.find_matches(token_keys(toks)).scores == {W0: 1}
    bad = [[-1] * 16, [2**63] * 16]  # below 0; past int64
    batch = [BlockStored([2 + i], None, ids, 16, None) for i, ids in enumerate(bad)]
    pub.send_multipart(frames(1, ArrayBatch(1.0, [*batch, BlockRemoved([1])])))
    wait_until(lambda: subs.counts["events"] == 2, subs)
    assert subs.counts["untokenized_events"] == 2 and subs.counts["bad_messages"] == 0
    assert router.find_matches(token_keys(toks)).scores == {}


@pytest.mark.parametrize("size", [8, 32])
def test_blocks_of_another_size_are_not_keyed(size: int) -> None:
    keyer = TokenKeyer(HASHER)
    event = decode_vllm(frames(0, ArrayBatch(1.0, [BlockStored([1], None, [0] * size, size, 0)])))
    with pytest.raises(ValueError, match="router keys blocks of 16"):
        keyer.translate(W0, event.events[0], StoredTokens([0] * size, size, None))
