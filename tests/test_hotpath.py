"""Lookups and CPU-hit loads through the hot index, against real sidecars
(docs/sidecar.md, "The hot path"): no request is sent for them, what they
did reaches the sidecar's figures in Touch batches, evictions and deletes
are misses at once, a lower tier is still asked, a restarted sidecar's
predecessor's index is withdrawn, and a malformed Touch changes nothing."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import sidecar_proc as sp
import torch
from sidecar_proc import Sidecar, connect, make_kv, stats_of, tmp_dir, tokens, wait_for

from contract import protocol as p
from engine_shim import SidecarError, SidecarUnavailable, hotpath
from engine_shim.channel import Channel
from shm import hotindex

pytestmark = pytest.mark.skipif(not hotindex.AVAILABLE, reason="shm._hotindex is not built")

ASKED = ("lookup", "load")


def asked(s: Sidecar) -> dict[str, int]:
    """Lookups and loads the sidecar was asked for."""
    requests = stats_of(s)["requests"]
    return {op: requests.get(op, 0) for op in ASKED}


def same_blocks(a: list, blocks_a: np.ndarray, b: list, blocks_b: np.ndarray) -> bool:
    return all(torch.equal(x[blocks_a], y[blocks_b]) for x, y in zip(a, b, strict=True))


def test_lookups_and_cpu_loads_ask_nothing_and_are_counted_later(sidecar, open_client):
    src, dst = make_kv(1), make_kv(None)
    saver = open_client(sidecar.endpoint, src)
    engine = open_client(sidecar.endpoint, dst)
    assert saver.save(tokens(6), np.arange(6)).wait() == 6 * sp.TOKENS_PER_BLOCK
    before = asked(sidecar)
    assert engine.lookup(tokens(8)) == 6 * sp.TOKENS_PER_BLOCK
    assert engine.lookup(tokens(8, start=7)) == 0  # the first block misses
    assert engine.lookup_tiers(tokens(3)) == (3 * sp.TOKENS_PER_BLOCK, 0, 0)
    handle = engine.load(tokens(8), np.arange(20, 28))
    assert handle.done and handle.wait() == 6 * sp.TOKENS_PER_BLOCK
    assert same_blocks(dst, np.arange(20, 26), src, np.arange(6))
    skipped = engine.load(tokens(6), np.arange(30, 36), skip_tokens=2 * sp.TOKENS_PER_BLOCK)
    assert skipped.wait() == 6 * sp.TOKENS_PER_BLOCK
    assert same_blocks(dst, np.arange(32, 36), src, np.arange(2, 6))
    assert asked(sidecar) == before
    figures = engine.stats()  # sends the batch first
    assert figures["transfers"]["loads"] == 2
    assert figures["transfers"]["loaded_blocks"] == 6 + 4
    assert figures["hits"]["requests"] == 3
    assert figures["hits"]["requested_blocks"] == 8 + 8 + 3
    assert figures["hits"]["hit_blocks"]["cpu"] == 6 + 3


def test_the_heartbeat_sends_the_batch_of_an_idle_engine():
    s = Sidecar(lease=1.0).start()
    try:
        with connect(s.endpoint, make_kv(2)) as c:
            assert c.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
            assert c.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
            wait_for(lambda: stats_of(s)["hits"]["requests"] == 1)
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_deleted_and_evicted_blocks_miss_at_once(open_client):
    s = Sidecar("--set", "evict_ratio=0", capacity="1MiB").start()  # 256 blocks of 4 KiB
    try:
        src = make_kv(3)
        c = open_client(s.endpoint, src)
        assert c.save(tokens(4), np.arange(4)).wait() == 4 * sp.TOKENS_PER_BLOCK
        assert c.delete(tokens(3)) == 2  # blocks 2 and 3
        assert c.lookup(tokens(4)) == 2 * sp.TOKENS_PER_BLOCK
        assert c.load(tokens(4), np.arange(10, 14)).wait() == 2 * sp.TOKENS_PER_BLOCK
        # Fill the tier twice over: the first prompt's blocks are evicted.
        first = tokens(64, start=1000)
        assert c.save(first, np.arange(64)).wait() == 64 * sp.TOKENS_PER_BLOCK
        for round_ in range(8):
            c.save(tokens(64, start=100_000 + 1000 * round_), np.arange(64)).wait()
        cached = c.lookup(first)
        assert cached < 64 * sp.TOKENS_PER_BLOCK
        assert c.load(first, np.arange(64)).wait() == cached
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_restarted_sidecar_withdraws_its_predecessors_index(open_client):
    s = Sidecar(lease=60.0).start()  # heartbeats far apart: the client learns late
    try:
        c = open_client(s.endpoint, make_kv(4))
        assert c.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        assert c._hot_flags()
        s.kill()
        s.start()  # the same instance: withdraws the dead one's hot index
        assert c._hot_flags() == 0  # though its stamp is recent
        assert c.lookup(tokens(2)) == 0  # asked the new sidecar

        def saved_again() -> bool:
            try:  # the client reconnects and re-registers by itself
                return c.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
            except SidecarUnavailable:
                return False

        wait_for(saved_again)
        assert c._hot_flags()  # the new sidecar's index, mapped when re-registering
        before = asked(s)
        assert c.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
        assert asked(s) == before
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_cpu_miss_is_asked_where_a_lower_tier_may_hold_it(open_client):
    ssd = tmp_dir("ssd")
    s = Sidecar("--set", f"ssd_dirs={ssd}", "--set", "ssd_capacity_per_dir=8MiB").start()
    try:
        c = open_client(s.endpoint, make_kv(5))
        assert c.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        before = asked(s)
        assert c.lookup(tokens(3)) == 3 * sp.TOKENS_PER_BLOCK  # all in the CPU tier
        assert asked(s) == before
        assert c.lookup(tokens(5)) == 3 * sp.TOKENS_PER_BLOCK  # short: asked
        assert asked(s)["lookup"] == before["lookup"] + 1
        assert c.load(tokens(5), np.arange(10, 15)).wait() == 3 * sp.TOKENS_PER_BLOCK
        assert asked(s)["load"] == before["load"] + 1
        assert s.stop() == 0
    finally:
        s.cleanup()
        shutil.rmtree(ssd, ignore_errors=True)


def test_a_load_past_a_skip_refreshes_its_whole_prefix_for_the_eviction_policy(open_client):
    """As a planned load does: the Touch carries the prefix from its first
    block (the sidecar matches from the root), so under LRU the prompt
    loaded last outlives the blocks saved before it."""
    tpb = sp.TOKENS_PER_BLOCK
    s = Sidecar("--set", "eviction_policy=lru", "--set", "evict_ratio=0", capacity="1MiB").start()
    try:
        saver = open_client(s.endpoint, make_kv(1), hot_path=False)
        reader = open_client(s.endpoint, make_kv(None))
        prompt = tokens(4, start=29_000)
        assert saver.save(prompt, np.arange(4)).wait() == 4 * tpb  # the oldest blocks
        for i in range(6):
            saver.save(tokens(32, start=1000 * i), np.arange(32)).wait()
        loaded = reader.load(prompt, np.arange(4), skip_tokens=2 * tpb)
        assert loaded.done and loaded.wait() == 4 * tpb  # through the hot index
        assert reader.stats()["transfers"]["loaded_blocks"] == 2  # sends the Touch first
        for i in range(3):  # a third of the tier more: the oldest blocks go
            saver.save(tokens(32, start=100_000 + 1000 * i), np.arange(32)).wait()
        assert saver.lookup(tokens(32)) < 32 * tpb
        assert saver.lookup(prompt) == 4 * tpb
        saver.close()
        reader.close()
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_malformed_touch_is_refused_and_changes_nothing(sidecar, open_client):
    c = open_client(sidecar.endpoint, make_kv(6))
    before = stats_of(sidecar)["hits"]
    channel = Channel(sidecar.endpoint, 10.0)
    try:
        bad = [
            ([5, 6], [], b""),  # more hits than blocks asked
            ([1, 1, 2], [], b""),  # not pairs
            ([2, 1], [2], bytes(16)),  # load_blocks do not sum to the keys
            ([2, 1], [0], b""),  # an empty load
            ([2, 1], [], b"", [2], bytes(16)),  # seen_blocks do not sum to the keys
            ([2, 1], [], b"", [0], b""),  # an empty observed lookup
        ]
        for pairs, sizes, keys, *seen in bad:
            seen_blocks, seen_keys = seen or ([], b"")
            request = p.Touch(
                v=1, id=0, session=c.session, load_blocks=sizes, seen_blocks=seen_blocks
            )
            frames = [np.asarray(pairs, dtype=np.int64).tobytes(), keys, seen_keys]
            with pytest.raises(SidecarError):
                channel.call(request, frames)
        frames = [np.asarray([2, 1], dtype=np.int64).tobytes(), bytes(32), b""]
        for skip in ([1, 0], [2], [-1]):  # not one per load; the whole load; below 0
            request = p.Touch(
                v=1, id=0, session=c.session, load_blocks=[2], seen_blocks=[], load_skip=skip
            )
            with pytest.raises(SidecarError, match="load_skip"):
                channel.call(request, frames)
    finally:
        channel.close()
    assert stats_of(sidecar)["hits"] == before


def test_a_killed_sidecars_index_serves_its_intact_hits_until_its_stamp_is_old(open_client):
    s = Sidecar().start()
    try:
        src, dst = make_kv(7), make_kv(None)
        c = open_client(s.endpoint, src)
        engine = open_client(s.endpoint, dst)
        assert c.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        sp.shorten_timeout(engine, 0.5)
        s.kill()
        # Within the timeout a hit loads the intact bytes (no slot can be
        # handed out again without the sidecar), then the table is not trusted.
        loaded = engine.load(tokens(3), np.arange(20, 23))
        if loaded.num_tokens:
            n = loaded.num_tokens // sp.TOKENS_PER_BLOCK
            assert same_blocks(dst, np.arange(20, 20 + n), src, np.arange(n))
        wait_for(lambda: engine._hot_flags() == 0)
        assert engine.lookup(tokens(3)) == 0
    finally:
        s.cleanup()


def test_hot_path_false_asks_for_everything(sidecar, open_client):
    c = open_client(sidecar.endpoint, make_kv(8), hot_path=False)
    assert c.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    before = asked(sidecar)
    assert c.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
    assert c.load(tokens(2), np.arange(10, 12)).wait() == 2 * sp.TOKENS_PER_BLOCK
    assert asked(sidecar) == {op: before[op] + 1 for op in ASKED}
    c.hot_path = True
    assert c.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
    assert asked(sidecar)["lookup"] == before["lookup"] + 1


# ---- saves into granted slots -------------------------------------------------------


def granted(client) -> int:
    """Slots granted to `client` now (reading a Grant's answer if it came)."""
    client._link.hot.grants_usable(client._link.hot.index)
    return len(client._link.hot.index.granted)


def cpu_tier(s: Sidecar) -> tuple[int, int]:
    tier = stats_of(s)["tiers"]["cpu"]
    return tier["used_blocks"], tier["cached_blocks"]


def test_saves_commit_into_granted_slots_and_the_grant_goes_back(sidecar, open_client):
    src, dst = make_kv(9), make_kv(None)
    c = open_client(sidecar.endpoint, src)
    assert c.save(tokens(1, start=5000), np.arange(1)).wait() == sp.TOKENS_PER_BLOCK
    wait_for(lambda: granted(c) > 0)  # the first save asked for slots
    before = stats_of(sidecar)["requests"]
    for i in range(4):
        handle = c.save(tokens(3, start=100 * i), np.arange(3 * i, 3 * i + 3))
        assert handle.plan is None and handle.wait() == 3 * sp.TOKENS_PER_BLOCK
    requests = stats_of(sidecar)["requests"]
    assert requests["save"] == before["save"] and requests["commit"] == before.get("commit", 0) + 4
    engine = open_client(sidecar.endpoint, dst)
    for i in range(4):
        assert engine.load(tokens(3, start=100 * i), np.arange(20, 23)).wait() == 48
        assert same_blocks(dst, np.arange(20, 23), src, np.arange(3 * i, 3 * i + 3))
    used, cached = cpu_tier(sidecar)
    assert used > cached  # the rest of the grant
    c.close()
    assert cpu_tier(sidecar) == (cached, cached)


@pytest.mark.parametrize("hot_path", [True, False])
def test_repeated_engine_blocks_are_refused_before_anything_is_asked_or_copied(
    hot_path, sidecar, open_client
):
    """A save of one engine block under two keys would serve one block's KV
    for another's tokens; the hot path copied and committed it (only the
    sidecar refused it, on the protocol path). Both refuse it now, first."""
    c = open_client(sidecar.endpoint, make_kv(12), hot_path=hot_path)
    assert c.save(tokens(1, start=7000), np.arange(1)).wait() == sp.TOKENS_PER_BLOCK
    if hot_path:
        wait_for(lambda: granted(c) > 0)

    def state() -> tuple[dict[str, int], tuple[int, int]]:
        requests = stats_of(sidecar)["requests"]
        return {k: n for k, n in requests.items() if k != "stats"}, cpu_tier(sidecar)

    before = state()
    for call in (c.save, c.load):
        with pytest.raises(ValueError, match="block_ids repeat"):
            call(tokens(3, start=7100), [4, 5, 4])
    with pytest.raises(ValueError, match="block_ids repeat"):
        c.layered_save_keys(c.block_keys(tokens(2, start=7100)), [6, 6])
    assert state() == before
    assert c.lookup(tokens(3, start=7100)) == 0
    # Repeats in a skipped prefix are placeholders, never read: allowed.
    skip = 2 * sp.TOKENS_PER_BLOCK
    assert c.load(tokens(3, start=7200), [0, 0, 1], skip_tokens=skip).wait() == skip


def test_a_rank_holding_its_share_of_a_small_tier_asks_again_only_after_using_half(
    open_client,
):
    """A tier of 256 slots grants a rank 16 (1/16), fewer than GRANT_LOW: a
    save must not send a Grant each time it finds the rank below that
    (before: 72 Grants for these 40 saves)."""
    s = Sidecar(capacity="1MiB").start()  # 256 blocks of 4 KiB
    try:
        c = open_client(s.endpoint, make_kv(11))
        assert c.save(tokens(1, start=7000), np.arange(1)).wait() == sp.TOKENS_PER_BLOCK
        wait_for(lambda: granted(c) > 0)
        share = granted(c)
        assert 2 <= share < hotpath.GRANT_LOW  # what this test is about
        before = stats_of(s)["requests"]
        saves = 40
        for i in range(saves):
            assert c.save(tokens(1, start=8000 + i), np.arange(1)).wait() == sp.TOKENS_PER_BLOCK
            c.delete(tokens(1, start=8000 + i))
        requests = stats_of(s)["requests"]
        assert requests["commit"] - before.get("commit", 0) == saves  # every one through grants
        # About one Grant per half a share used, not one per save.
        assert requests["grant"] - before.get("grant", 0) <= saves // (share // 2) + 2
        c.close()
        assert s.stop() == 0
        assert s.shm_segments() == []
    finally:
        s.cleanup()


def test_two_engines_saving_one_prefix_store_it_once(sidecar, open_client):
    a_kv, b_kv = make_kv(10), make_kv(10)  # the same KV: the same model's output
    a, b = open_client(sidecar.endpoint, a_kv), open_client(sidecar.endpoint, b_kv)
    for c in (a, b):
        c.save(tokens(1, start=9000), np.arange(1)).wait()
        wait_for(lambda c=c: granted(c) > 0)
    saved = stats_of(sidecar)["transfers"]["saved_blocks"]
    first, second = a.save(tokens(6), np.arange(6)), b.save(tokens(6), np.arange(6))
    assert first.wait() == second.wait() == 6 * sp.TOKENS_PER_BLOCK
    assert stats_of(sidecar)["transfers"]["saved_blocks"] == saved + 6
    dst = make_kv(None)
    assert open_client(sidecar.endpoint, dst).load(tokens(6), np.arange(30, 36)).wait() == 96
    assert same_blocks(dst, np.arange(30, 36), a_kv, np.arange(6))
    a.close()
    b.close()
    used, cached = cpu_tier(sidecar)
    assert used == cached


def test_a_commit_that_could_not_be_sent_keeps_its_slots_granted(sidecar, open_client):
    """A commit whose send fails (over tcp, a dropped connection to the same
    sidecar) committed nothing: its slots stay in the grant (before, they
    were lost to the session until it ended) and the next save uses them."""
    c = open_client(sidecar.endpoint, make_kv(13))
    assert c.save(tokens(1, start=8000), np.arange(1)).wait() == sp.TOKENS_PER_BLOCK
    wait_for(lambda: granted(c) > 0)
    hot = c._link.hot
    held = sorted(hot.index.granted)
    send = hot._channel.send

    def unreachable(*args: object, **kwargs: object) -> int:
        raise SidecarUnavailable("no sidecar connected (injected)")

    hot._channel.send = unreachable  # type: ignore[method-assign]
    try:
        with pytest.raises(SidecarUnavailable):
            c.save(tokens(2, start=8100), np.arange(2))
    finally:
        hot._channel.send = send  # type: ignore[method-assign]
    assert sorted(hot.index.granted) == held
    assert c.save(tokens(2, start=8100), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    assert c.lookup(tokens(2, start=8100)) == 2 * sp.TOKENS_PER_BLOCK


@pytest.mark.parametrize("engine_id", [None, "one-engine"])  # None: a new one each time
def test_registering_again_gives_the_grant_back_and_no_save_writes_into_it(engine_id, open_client):
    """The grant of a session that registers again (another engine, or the
    same rank again) is the sidecar's once more: the client forgets it
    (before, it kept writing into slots the sidecar had handed to other
    blocks, whose loads then read its bytes), and it is freed once the
    client closes (before, the same rank's was leaked for good)."""
    tpb = sp.TOKENS_PER_BLOCK
    s = Sidecar(capacity="1MiB").start()  # 256 slots: a rank is granted 16
    try:
        a_kv, b_kv = make_kv(13), make_kv(14)
        a = open_client(s.endpoint, a_kv, engine_id=engine_id)
        a.save(tokens(1, start=90_000), np.arange(1)).wait()
        wait_for(lambda: granted(a) > 0)
        a.register(a_kv, **sp.MODEL, engine_id=engine_id)
        assert granted(a) == 0  # forgotten; asked for again with the next save
        b = open_client(s.endpoint, b_kv, hot_path=False)
        prompts = [tokens(8, start=1000 * (i + 1)) for i in range(30)]  # the tier over
        for i, prompt in enumerate(prompts):
            b.save(prompt, np.arange(8 * (i % 8), 8 * (i % 8) + 8)).wait()
        assert a.save(tokens(16, start=50_000), np.arange(16)).wait() == 16 * tpb
        dst = make_kv(None)
        c = open_client(s.endpoint, dst)
        for i, prompt in enumerate(prompts):
            n = c.load(prompt, np.arange(8)).wait() // tpb
            assert same_blocks(dst, np.arange(n), b_kv, np.arange(8 * (i % 8), 8 * (i % 8) + n))
        for client in (a, b, c):
            client.close()
        used, cached = cpu_tier(s)
        assert used == cached  # no slot held by anyone
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_committed_save_counts_only_what_the_sidecar_kept(open_client):
    """A namespace's quota takes 4 of a save's 8 new blocks: the handle says
    so (before, it counted every block, and SGLang took the dropped pages
    for backed up)."""
    tpb = sp.TOKENS_PER_BLOCK
    s = Sidecar("--set", "namespace_limits=tenant=trial cpu=64KiB", capacity="1MiB").start()
    try:  # 4 KiB blocks: the tenant may hold 16
        planned = open_client(s.endpoint, make_kv(15), tenant="trial", hot_path=False)
        prompt = tokens(20, start=40_000)
        assert planned.save(prompt[: 12 * tpb], np.arange(12)).wait() == 12 * tpb
        hot = open_client(s.endpoint, make_kv(15), tenant="trial")
        hot.save(tokens(1, start=90_000), np.arange(1)).wait()
        wait_for(lambda: granted(hot) >= 8)
        handle = hot.save(prompt, np.arange(20))
        assert handle.plan is None  # through the grant
        assert handle.wait() == 16 * tpb
        assert hot.lookup(prompt) == 16 * tpb
        assert s.stop() == 0
    finally:
        s.cleanup()


def hold_grants_worker(endpoint: str, conn) -> None:
    """An engine that takes a grant, says so, and waits to be killed."""
    c = connect(endpoint, make_kv(11))
    c.save(tokens(1, start=7000), np.arange(1)).wait()
    wait_for(lambda: granted(c) > 0)
    conn.send(granted(c))
    conn.recv()  # killed before this comes


def test_an_engine_killed_holding_a_grant_leaks_nothing(sidecar):
    parent, child = sp.SPAWN.Pipe()
    proc = sp.SPAWN.Process(target=hold_grants_worker, args=(sidecar.endpoint, child))
    proc.start()
    try:
        assert parent.poll(sp.DEADLINE) and parent.recv() > 0
        used, cached = cpu_tier(sidecar)
        assert used > cached
        proc.kill()
        proc.join(sp.DEADLINE)
        wait_for(lambda: cpu_tier(sidecar) == (cached, cached))  # its pid is gone: freed
        assert stats_of(sidecar)["engines"] == []
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(sp.DEADLINE)


def test_a_commit_of_slots_not_granted_is_refused_and_changes_nothing(sidecar, open_client):
    c = open_client(sidecar.endpoint, make_kv(12))
    c.save(tokens(1, start=8000), np.arange(1)).wait()
    wait_for(lambda: granted(c) > 1)
    mine = c._link.hot.index.granted[:2]
    other = next(s for s in range(1 << 20) if s not in c._link.hot.index.granted)
    before = cpu_tier(sidecar)
    channel = Channel(sidecar.endpoint, 10.0)
    try:
        keys = c.block_keys(tokens(2))
        for slots in ([mine[0], mine[0]], [mine[0], other], [mine[0]]):
            request = p.Commit(v=1, id=0, session=c.session, first=0, boot_id=c._link.boot_id)
            frames = [p.keys_frame(keys), np.asarray(slots, dtype=np.int64).tobytes()]
            with pytest.raises(SidecarError):
                channel.call(request, frames)
    finally:
        channel.close()
    assert cpu_tier(sidecar) == before
    assert c.lookup(tokens(2)) == 0


def test_a_commit_of_another_boot_is_refused_and_changes_nothing(sidecar, open_client):
    """A restarted sidecar may grant the same slot numbers to the same
    session again: a commit names the boot whose grant it used."""
    c = open_client(sidecar.endpoint, make_kv(12))
    c.save(tokens(1, start=8000), np.arange(1)).wait()
    index = c._link.hot.index
    wait_for(lambda: c._link.hot.grants_usable(index) and len(index.granted) >= 2)
    c._link.heartbeat.stop()  # no idle release meanwhile
    mine = index.granted[:2]
    keys = c.block_keys(tokens(2))
    frames = [p.keys_frame(keys), np.asarray(mine, dtype=np.int64).tobytes()]
    before = cpu_tier(sidecar)
    channel = Channel(sidecar.endpoint, 10.0)
    try:
        other = p.Commit(v=1, id=0, session=c.session, first=0, boot_id="another boot")
        with pytest.raises(SidecarError, match="another boot"):
            channel.call(other, frames)
        assert cpu_tier(sidecar) == before and c.lookup(tokens(2)) == 0
        right = p.Commit(v=1, id=0, session=c.session, first=0, boot_id=index.boot_id)
        reply, _ = channel.call(right, frames)  # the slots were still granted
        assert reply.stored == 2
    finally:
        channel.close()


def test_a_save_begun_before_a_restart_commits_nothing_to_the_new_sidecar(open_client):
    """A save copies into slots of the grant of the sidecar it had then;
    that sidecar dies and a new one starts (granting the same slot numbers
    to the same session, from an empty pool) before the save commits: the
    new sidecar must not publish its own unwritten slots under the save's
    keys (another engine loaded zeros as the prompt's KV)."""
    s = Sidecar(lease=60.0).start()
    try:
        src = make_kv(None)
        c = open_client(s.endpoint, src)
        for i in range(3):  # the grant comes with the first, the others use it
            c.save(tokens(4, start=5000 + 100 * i), np.arange(4)).wait()
        old = c._link.hot.index
        assert old is not None and c._link.hot.grants_usable(old)
        for layer in src:
            layer[8:12].normal_()
        save = c.layered_save_keys(c.block_keys(tokens(4, start=100)), np.arange(8, 12))
        assert save.plan is None  # through the grant
        save.copy_layers(save.num_layers)
        s.kill()
        s.start()

        def saved_again() -> bool:
            try:  # the client re-registers by itself and maps the new index
                return c.save(tokens(4, start=9000), np.arange(16, 20)).wait() > 0
            except SidecarUnavailable:
                return False

        wait_for(saved_again)
        assert c._link.hot.index is not old
        assert save.finish().wait() == 0  # nothing cached: its bytes went to the dead pool
        other = open_client(s.endpoint, make_kv(None))
        assert other.lookup(tokens(4, start=100)) == 0
        assert s.stop() == 0
    finally:
        s.cleanup()


def committed_saves(s: Sidecar, open_client, src: list) -> None:
    """Three 4-block prompts saved through grants (asserted: no Save sent)."""
    c = open_client(s.endpoint, src)
    c.save(tokens(1, start=6000), np.arange(1)).wait()
    wait_for(lambda: granted(c) > 0)
    before = stats_of(s)["requests"]
    for i in range(3):
        handle = c.save(tokens(4, start=100 * i), np.arange(4 * i, 4 * i + 4))
        assert handle.plan is None and handle.wait() == 4 * sp.TOKENS_PER_BLOCK
    assert stats_of(s)["requests"]["save"] == before["save"]


def reloaded(s: Sidecar, open_client, src: list) -> None:
    dst = make_kv(None)
    engine = open_client(s.endpoint, dst)
    for i in range(3):
        assert engine.lookup_tiers(tokens(4, start=100 * i))[1] == 4 * sp.TOKENS_PER_BLOCK
        assert engine.load(tokens(4, start=100 * i), np.arange(20, 24)).wait() == 64
        assert same_blocks(dst, np.arange(20, 24), src, np.arange(4 * i, 4 * i + 4))


def test_committed_saves_are_written_through_to_ssd(open_client):
    ssd, run = tmp_dir("ssd"), tmp_dir("run")
    args = ("--set", f"ssd_dirs={ssd}", "--set", "ssd_capacity_per_dir=8MiB")
    s = Sidecar(*args, runtime_dir=run).start()
    try:
        src = make_kv(13)
        committed_saves(s, open_client, src)
        wait_for(lambda: stats_of(s)["tiers"]["ssd"]["cached_blocks"] == 1 + 3 * 4)
        assert s.stop() == 0
        s.start()  # an empty CPU tier: the blocks come back from SSD
        reloaded(s, open_client, src)
        assert s.stop() == 0
    finally:
        s.cleanup()
        shutil.rmtree(ssd, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


def test_committed_saves_are_written_back_when_evicted(open_client):
    ssd = tmp_dir("ssd")
    args = ("--set", f"ssd_dirs={ssd}", "--set", "ssd_capacity_per_dir=8MiB")
    s = Sidecar(*args, "--set", "write_policy=write_back", capacity="1MiB").start()
    try:
        src = make_kv(14)
        committed_saves(s, open_client, src)
        assert stats_of(s)["tiers"]["ssd"]["cached_blocks"] == 0
        filler = open_client(s.endpoint, make_kv(15))
        for i in range(12):  # 384 blocks through a 256-block tier: the first ones go down
            filler.save(tokens(32, start=10_000 + 100 * i), np.arange(32)).wait()
        wait_for(lambda: stats_of(s)["plans_in_flight"] == 0)
        reloaded(s, open_client, src)
        assert s.stop() == 0
    finally:
        s.cleanup()
        shutil.rmtree(ssd, ignore_errors=True)


def test_an_idle_rank_gives_its_grant_back_so_another_geometry_gets_space(monkeypatch):
    """Granted slots are space no other geometry may take: an extent holding
    one never changes hands. Model A's ranks filled the tier and went idle,
    still connected; model B (another geometry) then stored nothing at all."""
    monkeypatch.setattr(hotpath, "GRANT_IDLE_SECONDS", 0.5)
    s = Sidecar("--set", "cpu_extent_size=1MiB", capacity="4MiB").start()
    engines = []
    try:
        for seed in range(4):  # A: 4 ranks of one model, the tier full of their blocks
            a = connect(s.endpoint, make_kv(seed))
            engines.append(a)
            for i in range(60):
                a.save(tokens(16, start=5000 * seed + 37 * i), np.arange(16)).wait()
        assert any(a._link.hot.index.granted for a in engines)
        # Idle: each heartbeat gives its rank's grant back.
        wait_for(lambda: not any(a._link.hot.index.granted for a in engines))
        b_kv = [torch.randn(64, 2, 16, 4, 16) for _ in range(3)]  # another geometry
        other = {"model_name": "other", "num_kv_heads": 4, "head_dim": 16}
        with connect(s.endpoint, b_kv, **other) as b:
            assert b.save(tokens(8, start=100), np.arange(8)).wait() == 8 * sp.TOKENS_PER_BLOCK
            assert [g["extents"] > 0 for g in stats_of(s)["geometries"]] == [True, True]
    finally:
        for a in engines:
            a.close()
        assert s.stop() == 0
        s.cleanup()


def granted_to(s: Sidecar) -> int:
    """Slots the sidecar holds granted to its engines."""
    return sum(e["granted_slots"] for e in stats_of(s)["engines"])


def cpu_used(s: Sidecar) -> int:
    """Slots in use in the CPU tier (blocks, and slots granted ahead)."""
    return stats_of(s)["geometries"][0]["tiers"]["cpu"]["used_blocks"]


def test_a_release_of_another_boot_is_refused_and_changes_nothing(sidecar, open_client):
    c = open_client(sidecar.endpoint, make_kv(7))
    c.save(tokens(2), np.arange(2)).wait()
    index = c._link.hot.index
    wait_for(lambda: c._link.hot.grants_usable(index) and len(index.granted) >= 4)
    c._link.heartbeat.stop()  # no idle release of its own meanwhile
    channel = Channel(sidecar.endpoint, 10.0)
    try:
        used = cpu_used(sidecar)
        other = p.Release(v=1, id=0, session=c.session, boot_id="another boot")
        with pytest.raises(SidecarError, match="another boot"):
            channel.call(other)  # its slot numbers may be granted again since
        assert cpu_used(sidecar) == used
        held = granted_to(sidecar)
        assert held >= 4
        index.take_idle_grant(0.0)  # the client gives its grant up, then tells the sidecar
        channel.call(p.Release(v=1, id=0, session=c.session, boot_id=index.boot_id))
        assert cpu_used(sidecar) == used - held and granted_to(sidecar) == 0
    finally:
        channel.close()


def test_an_idle_rank_gives_back_a_grant_whose_answer_it_never_read(monkeypatch, sidecar):
    """A save asks for more slots unawaited; the answer is read by the next
    save. A rank that went idle right after held those slots for good."""
    monkeypatch.setattr(hotpath, "GRANT_IDLE_SECONDS", 0.5)
    c = connect(sidecar.endpoint, make_kv(8))
    try:
        c.save(tokens(2), np.arange(2)).wait()  # its first save asks for a grant
        assert c._link.hot.index.grant_request is not None  # and has not read it
        wait_for(lambda: granted_to(sidecar) > 0)
        wait_for(lambda: granted_to(sidecar) == 0)  # given back, unread
        assert c.save(tokens(4), np.arange(4)).wait() == 4 * sp.TOKENS_PER_BLOCK  # still saves
    finally:
        c.close()


def test_slots_taken_before_the_sidecar_forgot_the_session_are_not_given_back(sidecar, open_client):
    """A save that fails after a re-registration used to put its slots back
    in the new grant: slots the sidecar holds for the old session, freed
    after 10 leases and reused, that a later save would have copied into."""
    c = open_client(sidecar.endpoint, make_kv(9))
    c.save(tokens(2), np.arange(2)).wait()
    index = c._link.hot.index
    wait_for(lambda: c._link.hot.grants_usable(index) and len(index.granted) >= 4)
    slots, epoch = index.take_granted(2)
    assert index.in_flight == 1
    index.clear_granted()  # the sidecar forgot the session (`grants_lost`)
    index.give_back(slots, epoch)  # the failed save's copy ends after that
    assert index.granted == [] and index.in_flight == 0
    index.add_granted([1, 2])
    mine, now = index.take_granted(1)
    index.give_back(mine, now)  # a save of this epoch does give back
    assert index.granted == [1, 2] and index.in_flight == 0
