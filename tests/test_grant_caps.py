"""How many free CPU slots a rank is granted ahead for its saves
(sidecar/server/hotpath.py `grant`): up to 1/16 of the tier while slots
are free, but only 1/64 of it (at least 16, within the 1/16) where they
must be evicted for (a slot granted ahead is a block evicted ahead)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import keys, make_engine, put_ready

from contract.protocol import ProtocolError
from sidecar.server.hotpath import (
    GRANT_EVICT_MIN,
    GRANT_EVICT_SHARE,
    GRANT_SHARE,
    MAX_GRANT,
    grant,
)
from sidecar.server.sessions import Session


def session(name: str) -> Session:
    return Session(session_id=name, group=None, rank=0, pid=1, last_seen=0.0)  # type: ignore[arg-type]


def test_free_slots_are_granted_up_to_a_sixteenth_and_evicted_ones_a_sixty_fourth():
    engine = make_engine("cpu", 2048, "lru")
    a, b = session("a"), session("b")
    assert grant(a, engine, MAX_GRANT).size == 2048 // GRANT_SHARE == 128  # all free
    assert grant(a, engine, MAX_GRANT).size == 0  # it holds its share
    for i in range(2048 - 128):  # the rest of the tier full of cached blocks
        put_ready(engine, keys(10_000 + i))
    assert engine.mempool.num_free == 0
    before = engine.index.num_blocks
    got = grant(b, engine, MAX_GRANT)
    assert got.size == 2048 // GRANT_EVICT_SHARE == 32
    assert engine.index.num_blocks == before - 32  # evicted for, no more
    assert grant(b, engine, MAX_GRANT).size == 0
    assert len(np.intersect1d(list(a.granted), list(b.granted))) == 0


def test_a_partly_free_tier_grants_its_free_slots_first():
    engine = make_engine("cpu", 2048, "lru")
    for i in range(2048 - 40):
        put_ready(engine, keys(20_000 + i))
    assert grant(session("s"), engine, 48).size == 40  # 40 free, and no more than 32 evicted for
    engine2 = make_engine("cpu", 2048, "lru")
    for i in range(2048 - 10):
        put_ready(engine2, keys(30_000 + i))
    assert grant(session("t"), engine2, 48).size == 32  # 10 free, up to 32 with evictions


def test_a_small_full_tier_grants_as_before_and_a_tiny_one_none():
    small = make_engine("cpu", 256, "lru")
    for i in range(256):
        put_ready(small, keys(40_000 + i))
    assert grant(session("s"), small, MAX_GRANT).size == GRANT_EVICT_MIN == 256 // GRANT_SHARE
    tiny = make_engine("cpu", 48, "lru")
    for i in range(48):
        put_ready(tiny, keys(50_000 + i))
    assert grant(session("t"), tiny, MAX_GRANT).size == 48 // GRANT_SHARE == 3
    assert grant(session("u"), make_engine("cpu", 15, "lru"), MAX_GRANT).size == 0


@pytest.mark.parametrize("want", [0, MAX_GRANT + 1])
def test_a_bad_want_is_refused(want):
    with pytest.raises(ProtocolError):
        grant(session("x"), make_engine("cpu", 64, "lru"), want)
