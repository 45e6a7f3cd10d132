"""The data path between engines and a real sidecar: save, lookup, load,
delete, byte exact over real shm; and the structured refusal of bad requests."""

from __future__ import annotations

import numpy as np
import pytest
import sidecar_proc as sp
import torch
from sidecar_proc import (
    SPAWN,
    Sidecar,
    connect,
    expected_blocks,
    make_kv,
    run,
    stats_of,
    tokens,
)

from contract import protocol as p
from engine_shim import SidecarError
from engine_shim.channel import Channel


def test_kv_saved_by_one_engine_loads_byte_exact_in_another(sidecar):
    assert run(sp.save_worker, sidecar.endpoint, 7, 5) == 5 * sp.TOKENS_PER_BLOCK
    loaded, blocks = run(sp.load_worker, sidecar.endpoint, 5)
    assert loaded == 5 * sp.TOKENS_PER_BLOCK
    assert blocks == expected_blocks(7, 5)


def test_only_full_blocks_are_cached_and_lookup_counts_tokens(sidecar):
    kv = make_kv(3)
    with connect(sidecar.endpoint, kv) as client:
        assert client.lookup(tokens(4, tail=5)) == 0
        assert client.save(tokens(4, tail=5), np.arange(4)).wait() == 4 * sp.TOKENS_PER_BLOCK
        assert client.lookup(tokens(4, tail=5)) == 4 * sp.TOKENS_PER_BLOCK
        assert client.lookup(tokens(6)) == 4 * sp.TOKENS_PER_BLOCK
        assert client.lookup(tokens(4, start=1)) == 0
        assert client.exists(tokens(4)) and not client.exists(tokens(5))
        assert client.save(tokens(6), np.arange(6)).wait() == 6 * sp.TOKENS_PER_BLOCK
        assert stats_of(sidecar)["tiers"]["cpu"]["cached_blocks"] == 6
        assert client.delete(tokens(5)) == 2
        assert client.lookup(tokens(6)) == 4 * sp.TOKENS_PER_BLOCK


def test_a_long_request_whose_frames_go_zero_copy_loads_byte_exact():
    """8,192 blocks: 128 KiB of keys, 64 KiB id frames each way, so every
    array frame of the save, the load and their plans is sent in place."""
    n = 8192
    assert n * p.ID_DTYPE.itemsize >= p.ZERO_COPY_BYTES
    s = Sidecar(capacity="40MiB").start()
    try:
        kv, fresh = make_kv(5, num_blocks=n), make_kv(None, num_blocks=n)
        with connect(s.endpoint, kv) as saver, connect(s.endpoint, fresh) as loader:
            assert saver.save(tokens(n), np.arange(n)).wait() == n * sp.TOKENS_PER_BLOCK
            assert loader.lookup(tokens(n)) == n * sp.TOKENS_PER_BLOCK
            order = np.random.default_rng(0).permutation(n)  # blocks land out of order
            assert loader.load(tokens(n), order).wait() == n * sp.TOKENS_PER_BLOCK
        for mine, theirs in zip(fresh, kv, strict=True):
            assert torch.equal(mine[order], theirs)
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_lookup_tiers_and_registering_again_with_other_tensors(sidecar):
    with connect(sidecar.endpoint, make_kv(3)) as client:
        assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        assert client.lookup_tiers(tokens(3, tail=1)) == (3 * sp.TOKENS_PER_BLOCK, 0, 0)
        fresh = make_kv(None)
        client.register(fresh, **sp.MODEL)  # the copies now go to and from `fresh`
        assert client.load(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        assert [layer[:3].numpy().tobytes() for layer in fresh] == expected_blocks(3, 3)


def test_concurrent_saves_of_one_prefix_store_it_once(sidecar):
    with SPAWN.Manager() as manager, SPAWN.Pool(2) as pool:
        barrier = manager.Barrier(2)
        results = [pool.apply_async(sp.save_worker, (sidecar.endpoint, 11, 6, barrier))] * 1
        results.append(pool.apply_async(sp.save_worker, (sidecar.endpoint, 11, 6, barrier)))
        # two spawned engines importing torch: slow on a loaded machine
        assert [r.get(sp.DEADLINE) for r in results] == [6 * sp.TOKENS_PER_BLOCK] * 2
    cpu = stats_of(sidecar)["tiers"]["cpu"]
    assert cpu["cached_blocks"] == 6 and cpu["used_blocks"] == 6
    assert run(sp.load_worker, sidecar.endpoint, 6)[1] == expected_blocks(11, 6)


def test_a_block_is_invisible_until_its_save_completes(sidecar):
    kv = make_kv(5)
    with connect(sidecar.endpoint, kv) as saver, connect(sidecar.endpoint, make_kv(None)) as other:
        keys = saver._keys(tokens(3))
        channel = Channel(sidecar.endpoint, 30.0)
        reply, _ = channel.call(
            p.Save(v=p.PROTOCOL_VERSION, id=0, session=saver.session),
            [p.keys_frame(keys), p.ids_frame(np.arange(3))],
        )
        assert reply.stored_blocks == 3
        assert other.lookup(tokens(3)) == 0
        assert other.load(tokens(3), np.arange(3)).wait() == 0
        op = reply.ops[0]
        channel.call(
            p.Complete(
                v=p.PROTOCOL_VERSION,
                id=0,
                session=saver.session,
                plan_id=reply.plan_id,
                op_ids=[op.op_id],
            )
        )
        assert other.lookup(tokens(3)) == 3 * sp.TOKENS_PER_BLOCK
        channel.close()


def test_refusals_are_structured_and_change_nothing(sidecar, open_client):
    a = open_client(sidecar.endpoint, make_kv(1), engine_id="a")
    b = open_client(sidecar.endpoint, make_kv(None), engine_id="b")
    channel = Channel(sidecar.endpoint, 30.0)
    keys = a._keys(tokens(2))
    reply, _ = channel.call(
        p.Save(v=p.PROTOCOL_VERSION, id=0, session=a.session),
        [p.keys_frame(keys), p.ids_frame(np.arange(2))],
    )
    before = stats_of(sidecar)["tiers"]["cpu"]
    plan_id = reply.plan_id
    keys_frame = p.keys_frame(keys)

    def complete(session: str, plan: int, ops: list[int]) -> p.Complete:
        return p.Complete(v=1, id=0, session=session, plan_id=plan, op_ids=ops)

    bad = [
        (complete(b.session, plan_id, [0]), (), "not_owner"),
        (complete(a.session, 999, [0]), (), "unknown_plan"),
        (complete(a.session, plan_id, [5]), (), "bad_value"),
        (complete(a.session, plan_id, [0, 0]), (), "bad_value"),
        (p.Lookup(v=1, id=0, session="nobody"), [keys_frame], "not_registered"),
        (
            p.Load(v=1, id=0, session=a.session),
            [keys_frame, p.ids_frame(np.array([0, 64]))],
            "bad_value",
        ),
        (
            p.Load(v=1, id=0, session=a.session, skip=3),
            [keys_frame, p.ids_frame(np.arange(2))],
            "bad_value",
        ),
        # a part of a load in parts: past the keys, or ending before its skip
        (
            p.Load(v=1, id=0, session=a.session, end=3),
            [keys_frame, p.ids_frame(np.arange(2))],
            "bad_value",
        ),
        (
            p.Load(v=1, id=0, session=a.session, skip=2, end=1),
            [keys_frame, p.ids_frame(np.arange(2))],
            "bad_value",
        ),
        (
            p.Load(v=1, id=0, session=a.session, end=-1),
            [keys_frame, p.ids_frame(np.arange(2))],
            "bad_value",
        ),
        (p.Save(v=1, id=0, session=a.session), [keys_frame, b"short"], "bad_message"),
        # one engine block under two keys (a save), or copied into twice (a load)
        (
            p.Save(v=1, id=0, session=b.session),
            [p.keys_frame(b._keys(tokens(3, start=7))), p.ids_frame(np.array([5, 2, 5]))],
            "bad_value",
        ),
        (p.Load(v=1, id=0, session=a.session), [keys_frame, p.ids_frame([1, 1])], "bad_value"),
    ]
    for request, arrays, code in bad:
        with pytest.raises(SidecarError) as info:
            channel.call(request, arrays)
        assert info.value.code == code, request
    assert stats_of(sidecar)["tiers"]["cpu"] == before
    # Another geometry is another engine's to bring, not a refusal (issue 28):
    connect(sidecar.endpoint, make_kv(None, num_blocks=8)[:1], engine_id="c").close()
    for c in (a, b):
        c.close()
    channel.close()
