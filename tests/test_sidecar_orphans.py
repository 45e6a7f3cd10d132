"""Engines that fail mid-plan: killed, frozen past their lease, or a TP rank
giving a save up while another still copies. Nothing leaks, and a late copy
never lands in a slot another block now uses."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import sidecar_proc as sp
import torch
from sidecar_proc import (
    SPAWN,
    Sidecar,
    connect,
    make_kv,
    stats_of,
    tokens,
    wait_for,
)

from contract import protocol as p
from engine_shim import SidecarError


def test_an_engine_killed_mid_save_leaks_nothing(sidecar):
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=sp.hang_mid_save_worker, args=(sidecar.endpoint, 4, child))
    proc.start()
    assert parent.poll(sp.DEADLINE) and parent.recv() == 4
    assert stats_of(sidecar)["tiers"]["cpu"]["used_blocks"] == 4
    proc.kill()
    proc.join()
    wait_for(lambda: stats_of(sidecar)["tiers"]["cpu"]["used_blocks"] == 0)
    s = stats_of(sidecar)
    assert s["plans_in_flight"] == 0 and s["engines"] == []
    with connect(sidecar.endpoint, make_kv(None)) as client:
        assert client.lookup(tokens(4)) == 0


@pytest.mark.parametrize("then", ["continue", "kill"])
def test_an_engine_frozen_past_its_lease_never_writes_into_reused_slots(then):
    """An engine frozen between its save plan and its copy loses its lease,
    but may still wake up and copy: its blocks leave the index at once (so
    others can store that prefix), but its slots are held, not reused, until
    it reports or its process is gone; no block ever gets its bytes."""
    s = Sidecar(capacity="2MiB", lease=3.0).start()  # 8 slots of 256 KiB
    parent, child = SPAWN.Pipe()
    frozen = SPAWN.Process(target=sp.freeze_mid_save_worker, args=(s.endpoint, 4, child))
    frozen.start()
    try:
        assert parent.poll(sp.DEADLINE) and parent.recv() == "frozen"
        wait_for(lambda: stats_of(s)["expired_sessions"] == 1)
        st = stats_of(s)
        assert st["orphaned_plans"] == 1 and st["engines"] == []
        assert st["tiers"]["cpu"]["used_blocks"] == 4 and st["tiers"]["cpu"]["cached_blocks"] == 0
        other_kv = sp.big_kv(2.0)
        other = connect(s.endpoint, other_kv, **sp.BIG_MODEL)
        # The same prefix is not stuck "in flight": another engine stores it.
        assert other.save(tokens(4), np.arange(4)).wait() == 4 * sp.TOKENS_PER_BLOCK
        assert other.lookup(tokens(4)) == 4 * sp.TOKENS_PER_BLOCK
        # Filling the tier evicts those blocks, never takes the held slots.
        assert other.save(tokens(4, start=5000), np.arange(4)).wait() == 4 * sp.TOKENS_PER_BLOCK
        assert other.save(tokens(4, start=9000), np.arange(4)).wait() == 4 * sp.TOKENS_PER_BLOCK
        assert stats_of(s)["tiers"]["cpu"]["used_blocks"] == 8
        if then == "continue":
            os.kill(frozen.pid, signal.SIGCONT)  # it wakes up and copies into its slots
            # Its report (refused: the plan is gone) ends the orphan; the save failed.
            assert parent.poll(sp.DEADLINE) and parent.recv().startswith("SidecarError(")
        else:
            frozen.kill()
        frozen.join(sp.DEADLINE)
        wait_for(lambda: stats_of(s)["orphaned_plans"] == 0)
        assert stats_of(s)["tiers"]["cpu"]["used_blocks"] == 4
        for start in (0, 5000, 9000):
            got_kv = sp.big_kv(0.0)
            with connect(s.endpoint, got_kv, **sp.BIG_MODEL) as reader:
                n = reader.load(tokens(4, start=start), np.arange(4)).wait() // sp.TOKENS_PER_BLOCK
            for mine, got in zip(other_kv, got_kv, strict=True):
                assert np.array_equal(mine[:n].numpy(), got[:n].numpy()), "another engine's bytes"
        other.close()
    finally:
        if frozen.is_alive():
            frozen.kill()
        assert s.stop() == 0
        assert s.shm_segments() == []
        s.cleanup()


def tp_pair(s: Sidecar, engine_id: str, kvs: list, **kwargs: object) -> list:
    return [
        connect(s.endpoint, kv, tp_rank=r, engine_id=engine_id, tp_size=2, **sp.BIG_MODEL, **kwargs)
        for r, kv in enumerate(kvs)
    ]


def pair_save(pair: list, start: int, n: int) -> None:
    handle = pair[0].save(tokens(n, start=start), np.arange(n))
    if handle.plan is not None:
        pair[1].execute(handle.plan).wait()
    handle.wait()


def raw_save(client, n: int):
    """A save plan this client asked for and has not copied for yet."""
    from engine_shim.link import plan_ops

    keys = client.block_keys(tokens(n))
    reply, arrays = client._link.call(
        client._link.req(p.Save), [p.keys_frame(keys), p.ids_frame(np.arange(n))]
    )
    return plan_ops(reply, arrays, "save")


@pytest.mark.parametrize("report", ["fail", "cancel"])
def test_a_tp_rank_failing_a_save_leaves_its_slots_to_the_ranks_still_copying(report):
    """Rank 1 gives up on a save (a failed copy, or a cancel) while rank 0
    has not copied its shard yet: the plan is rolled back at once, but its
    slots are held until rank 0 reports, so rank 0's late copy lands in no
    other block."""
    s = Sidecar(capacity="4MiB").start()  # 8 slots of 2 ranks x 256 KiB
    leader, follower = tp_pair(s, "tp", [sp.big_kv(1.0), sp.big_kv(1.0)])
    other_kv = [sp.big_kv(2.0), sp.big_kv(2.0)]
    others = tp_pair(s, "other", other_kv)
    try:
        assert stats_of(s)["tiers"]["cpu"]["capacity_blocks"] == 8
        plan = raw_save(leader, 4)  # rank 0 has not copied yet
        if report == "fail":
            follower._link.fail(plan, RuntimeError("rank 1's copy failed"))
        else:
            follower._link.give_back(plan.plan_id)
        wait_for(lambda: stats_of(s)["orphaned_plans"] == 1)
        cpu = stats_of(s)["tiers"]["cpu"]
        assert cpu["used_blocks"] == 4 and cpu["cached_blocks"] == 0

        pair_save(others, 0, 4)  # the same prefix is not stuck "in flight"
        pair_save(others, 5000, 4)  # the tier is full: this evicts, never takes the held slots
        assert others[0].lookup(tokens(4, start=5000)) == 4 * sp.TOKENS_PER_BLOCK
        assert stats_of(s)["tiers"]["cpu"]["used_blocks"] == 8
        with pytest.raises(SidecarError):  # rank 0 copies late; its report is refused
            leader.execute(plan).wait()
        wait_for(lambda: stats_of(s)["orphaned_plans"] == 0)
        assert others[0].lookup(tokens(4)) == 0  # evicted for 5000's blocks
        handle = others[0].load(tokens(4, start=5000), np.arange(10, 14))
        others[1].execute(handle.plan).wait()
        assert handle.wait() == 4 * sp.TOKENS_PER_BLOCK
        for layer in other_kv[0]:  # rank 0's shard: what the late copy would overwrite
            assert np.array_equal(layer[10:14].numpy(), layer[:4].numpy()), "rank 0's bytes"
    finally:
        for client in (leader, follower, *others):
            client.close()
        assert s.stop() == 0
        s.cleanup()


@pytest.mark.parametrize("give_up", ["fail", "unregister"])
def test_an_orphan_holds_its_slots_while_the_plans_own_ssd_write_runs(tmp_path, give_up):
    """A write-through save of a prefix the CPU tier has but the SSD tier
    lost starts that prefix's SSD write at once, not after the engine's
    copy; a rank giving the plan up then finds it busy on an I/O thread, and
    its rollback runs only when the write returns. The slots must be held
    all the same, so rank 0's late copy lands in no other block."""
    s = Sidecar(
        "--set",
        f"ssd_dirs={tmp_path}",
        "--set",
        "ssd_capacity_per_dir=4MiB",
        "--set",
        "write_policy=write_through",
        capacity="16MiB",
    ).start()  # CPU 32 slots of 2 x 256 KiB, SSD 8
    leader, follower = tp_pair(s, "tp", [sp.big_kv(1.0), sp.big_kv(1.0)])
    other_kv = [[torch.full((48, *sp.BIG_BLOCK_SHAPE), 2.0) for _ in range(2)] for _ in range(2)]
    others = tp_pair(s, "other", other_kv)
    try:
        for start in (0, 10_000):  # K[0:8], then blocks for which the SSD evicts K
            pair_save(others, start, 8)
            wait_for(lambda: stats_of(s)["plans_in_flight"] == 0)  # on SSD too
        ssd = stats_of(s)["tiers"]["ssd"]
        assert ssd["cached_blocks"] == 8 and others[0].lookup(tokens(8)) == 8 * sp.TOKENS_PER_BLOCK
        plan = raw_save(leader, 16)  # K[0:16]: K[0:8] goes to SSD now, 8 new blocks
        if give_up == "fail":
            follower._link.fail(plan, RuntimeError("rank 1's copy failed"))
        else:
            follower.close()
        wait_for(lambda: stats_of(s)["plans_in_flight"] == 0)  # the SSD write returned
        cpu = stats_of(s)["tiers"]["cpu"]
        assert cpu["used_blocks"] - cpu["cached_blocks"] == 8  # held for rank 0
        pair_save(others, 20_000, 16)  # new blocks: never in the held slots
        with pytest.raises(SidecarError):
            leader.execute(plan).wait()  # rank 0 copies late; refused
        handle = others[0].load(tokens(16, start=20_000), np.arange(32, 48))
        others[1].execute(handle.plan).wait()
        assert handle.wait() == 16 * sp.TOKENS_PER_BLOCK
        for layer in other_kv[0]:
            assert bool((layer[32:48] == 2.0).all()), "rank 0's bytes in another block"
    finally:
        for client in (leader, follower, *others):
            client.close()
        assert s.stop() == 0
        s.cleanup()


@pytest.mark.parametrize("give_up", ["fail", "cancel"])
def test_a_requester_giving_up_before_its_copy_frees_the_slots_at_once(give_up):
    """The other ranks get a plan from the rank that asked for it, after its
    own copies (KVClient.save): if it fails its copy or cancels a reply that
    came too late, nobody else has the plan, and nothing is held."""
    s = Sidecar(capacity="4MiB").start()
    leader, follower = tp_pair(s, "tp", [sp.big_kv(1.0), sp.big_kv(1.0)])
    try:
        plan = raw_save(leader, 4)
        if give_up == "fail":
            leader._link.fail(plan, RuntimeError("rank 0's copy failed"))
        else:
            leader._link.give_back(plan.plan_id)
        wait_for(lambda: stats_of(s)["plans_in_flight"] == 0)
        st = stats_of(s)
        assert st["orphaned_plans"] == 0 and st["tiers"]["cpu"]["used_blocks"] == 0
    finally:
        leader.close()
        follower.close()
        assert s.stop() == 0
        s.cleanup()


def test_a_layer_wise_save_given_up_by_its_requester_waits_for_the_ranks_copying_it():
    """A layer-wise save goes to the other ranks before the requester has
    copied a layer: when the requester fails, rank 1 may still be copying
    layers into its slots. Those slots are held until rank 1 reports (before,
    they were freed at once, the next save got them, and rank 1's next layer
    overwrote that save's block)."""
    s = Sidecar(capacity="4MiB").start()  # 8 slots of 2 ranks x 256 KiB
    kvs = [sp.big_kv(1.0), sp.big_kv(2.0)]
    leader, follower = tp_pair(s, "tp", kvs)
    try:
        saving = leader.layered_save_keys(leader.block_keys(tokens(2)), [0, 1])
        copying = follower.execute_layered(saving.plan)
        copying.copy_layers(1)  # rank 1 has copied layer 0
        leader._link.fail(saving.plan, RuntimeError("rank 0's copy of layer 0 failed"))
        wait_for(lambda: stats_of(s)["orphaned_plans"] == 1)
        for kv, value in zip(kvs, (3.0, 4.0), strict=True):  # the next save's blocks
            for layer in kv:
                layer[2:4] = value
        handle = leader.save(tokens(2, start=100), [2, 3])
        follower.execute(handle.plan).wait()
        assert handle.wait() == 2 * sp.TOKENS_PER_BLOCK
        copying.copy_layers(2)  # rank 1's last layer lands in the held slots, not the new ones
        with pytest.raises(SidecarError):
            copying.finish().wait()
        wait_for(lambda: stats_of(s)["orphaned_plans"] == 0)
        handle = leader.load(tokens(2, start=100), [10, 11])
        follower.execute(handle.plan).wait()
        assert handle.wait() == 2 * sp.TOKENS_PER_BLOCK
        for kv, value in zip(kvs, (3.0, 4.0), strict=True):
            for layer in kv:
                assert bool((layer[10:12] == value).all()), "the given-up save's bytes"
    finally:
        leader.close()
        follower.close()
        assert s.stop() == 0
        s.cleanup()


def test_a_plan_runs_once_per_rank():
    """A save plan delivered twice (a relay, a retry) is refused by the rank
    before it copies: run again after it completed, it copied the engine's
    blocks as they are now over the published ones (the sidecar could only
    refuse the report that followed). A plan given back is not run either."""
    s = Sidecar(capacity="4MiB").start()
    kvs = [sp.big_kv(1.0), sp.big_kv(2.0)]
    leader, follower = tp_pair(s, "tp", kvs)
    try:
        handle = leader.save(tokens(2), [0, 1])
        follower.execute(handle.plan).wait()
        assert handle.wait() == 2 * sp.TOKENS_PER_BLOCK
        for kv in kvs:  # the engine reuses its blocks
            for layer in kv:
                layer[0:2] = 9.0
        for rank in (leader, follower):
            with pytest.raises(ValueError, match="run or given back by this rank already"):
                rank.execute(handle.plan)
        late = raw_save(leader, 3)  # blocks 0-2 of tokens(3): one new block
        follower.cancel(late)
        with pytest.raises(ValueError, match="already"):
            follower.execute(late)
        load = leader.load(tokens(2), [10, 11])
        follower.execute(load.plan).wait()
        assert load.wait() == 2 * sp.TOKENS_PER_BLOCK
        for kv, value in zip(kvs, (1.0, 2.0), strict=True):
            for layer in kv:
                assert bool((layer[10:12] == value).all()), "overwritten by the second run"
    finally:
        leader.close()
        follower.close()
        assert s.stop() == 0
        s.cleanup()


def test_a_load_parked_for_a_cpu_slot_is_retried_when_a_save_becomes_an_orphan(tmp_path):
    """The rollback of an orphaned save unlocks the prefix it had locked,
    which a load waiting for a CPU slot may evict: it is served then, not
    when the last writer reports."""

    s = Sidecar(
        "--set",
        f"ssd_dirs={tmp_path}",
        "--set",
        "ssd_capacity_per_dir=8MiB",
        "--set",
        "write_policy=write_through",
        capacity="4MiB",
        lease=10.0,
    ).start()  # CPU 8 slots
    leader, follower = tp_pair(s, "tp", [sp.big_kv(1.0), sp.big_kv(1.0)])
    others = tp_pair(s, "other", [sp.big_kv(2.0), sp.big_kv(2.0)], timeout=20.0)
    try:
        pair_save(others, 10_000, 4)  # X, on CPU and SSD
        pair_save(others, 0, 4)  # P: the CPU tier is full
        wait_for(lambda: stats_of(s)["plans_in_flight"] == 0)
        plan = raw_save(leader, 8)  # P + 4 new blocks: X evicted, every CPU block locked
        served: list[float] = []
        loads = stats_of(s)["requests"].get("load", 0)

        def load() -> None:
            handle = others[0].load(tokens(4, start=10_000), np.arange(8, 12))
            others[1].execute(handle.plan).wait()
            assert handle.wait() == 4 * sp.TOKENS_PER_BLOCK
            served.append(time.monotonic())

        waiter = threading.Thread(target=load)
        waiter.start()
        # parked once handled: no CPU slot to stage X into
        wait_for(lambda: stats_of(s)["requests"].get("load", 0) > loads)
        follower._link.fail(plan, RuntimeError("rank 1's copy failed"))
        failed = time.monotonic()
        waiter.join(sp.DEADLINE)  # its load gives up after 20 s (others' timeout)
        # Rank 0 reports only below; its lease (10 s) is renewed all along.
        assert served and served[0] - failed < 8, "the load waited for rank 0"
        with pytest.raises(SidecarError):
            leader.execute(plan).wait()
    finally:
        for client in (leader, follower, *others):
            client.close()
        assert s.stop() == 0
        s.cleanup()
