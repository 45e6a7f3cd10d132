"""Engines whose sidecar stalls, dies or restarts: one timeout, late replies
dropped, the client finds the new sidecar by itself, maps its pool and
unmaps the old one, and plans of the old boot are refused."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import sidecar_proc as sp
from sidecar_proc import (
    Sidecar,
    connect,
    make_kv,
    stats_of,
    tokens,
    wait_for,
)

from contract import protocol as p
from contract import replies as r
from engine_shim import SidecarUnavailable
from engine_shim.channel import Channel


def test_a_stalled_sidecar_costs_one_timeout_and_its_late_replies_are_dropped(sidecar, open_client):
    client = open_client(sidecar.endpoint, make_kv(11))
    assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    sp.shorten_timeout(client, 0.3)
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        # Its hot index serves CPU hits in this process until its stamp is
        # older than the client's timeout (test_hotpath.py); then the client asks.
        wait_for(lambda: client._hot_flags() == 0)
        start = time.monotonic()
        assert client.lookup(tokens(2)) == 0
        with pytest.raises(SidecarUnavailable, match=r"did not answer within 0\.3 s"):
            client.load(tokens(2), np.arange(2))
        assert time.monotonic() - start < 2 * 0.3 + 3.0  # not until the sidecar wakes
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    # The stalled lookup and load are answered now; those replies come before
    # the next one and must not be taken for it.
    assert client.lookup(tokens(3)) == 2 * sp.TOKENS_PER_BLOCK
    assert client.lookup(tokens(1)) == sp.TOKENS_PER_BLOCK

    # The late load's plan, which no copy will ever run, is given back when
    # the client reads its reply: at its next call. The sidecar may stamp its
    # hot index before it answers the stalled requests, so the lookups above
    # may have been answered here, before those replies came; each call reads
    # (without waiting) what has come. Then its locks are gone and the blocks
    # can be deleted.
    def given_back() -> bool:
        client.lookup(tokens(1))
        return not client._link.channel.late and stats_of(sidecar)["plans_in_flight"] == 0

    wait_for(given_back)
    assert client.delete(tokens(1)) == 2  # block 0 and the one below it
    client.close()


def test_a_save_answered_after_its_timeout_is_given_back(sidecar, open_client):
    client = open_client(sidecar.endpoint, make_kv(12), hot_path=False)  # plans, no grant
    sp.shorten_timeout(client, 0.3)
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(SidecarUnavailable):
            client.save(tokens(3), np.arange(3))
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    # A call reads the late save reply once it is there, and cancels its plan.
    wait_for(lambda: client.lookup(tokens(3)) == 0 and stats_of(sidecar)["plans_in_flight"] == 0)
    assert stats_of(sidecar)["tiers"]["cpu"]["used_blocks"] == 0
    # The prefix is not stuck "in flight": saving it again stores it.
    assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
    assert client.lookup(tokens(3)) == 3 * sp.TOKENS_PER_BLOCK
    client.close()


def test_engines_carry_on_when_the_sidecar_dies_and_find_it_again(sidecar, open_client):
    client = open_client(sidecar.endpoint, make_kv(9))
    assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    sp.shorten_timeout(client, 0.5)
    old_segments = sidecar.shm_segments()
    sidecar.proc.kill()
    sidecar.proc.wait()
    # Its hot index still serves the (intact) CPU hits until its stamp is
    # older than the client's timeout (test_hotpath.py); then the client asks.
    wait_for(lambda: client._hot_flags() == 0)
    start = time.monotonic()
    assert client.lookup(tokens(2)) == 0
    with pytest.raises(SidecarUnavailable):
        client.load(tokens(2), np.arange(2))
    with pytest.raises(SidecarUnavailable):
        client.save(tokens(2), np.arange(2))
    assert time.monotonic() - start < 3 * 0.5 + 3.0
    assert sidecar.shm_segments() == old_segments  # SIGKILL left them
    stale = {name: os.stat(f"/dev/shm/{name}").st_ino for name in old_segments}
    sidecar.start()  # same instance name: removes the stale segments first
    fresh = {name: os.stat(f"/dev/shm/{name}").st_ino for name in sidecar.shm_segments()}
    assert fresh and not set(fresh.items()) & set(stale.items()), "stale segments reused"

    def saved_again() -> bool:
        try:  # the client reconnects and re-registers by itself
            return client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        except SidecarUnavailable:
            return False

    wait_for(saved_again)
    assert client.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
    client.close()


def test_a_plan_from_before_a_sidecar_restart_is_refused(sidecar):
    kv0, kv1 = make_kv(16), make_kv(17)
    leader = connect(sidecar.endpoint, kv0, engine_id="tp", tp_size=2, tp_rank=0, timeout=0.5)
    follower = connect(sidecar.endpoint, kv1, engine_id="tp", tp_size=2, tp_rank=1, timeout=0.5)
    try:
        stale = leader.save(tokens(4), np.arange(4))
        stale.wait()
        sidecar.proc.kill()
        sidecar.proc.wait()
        sidecar.start()
        wait_for(lambda: [e["ranks"] for e in stats_of(sidecar)["engines"]] == [[0, 1]])
        # ... and the follower's heartbeat has read the new sidecar's reply
        wait_for(lambda: follower._link.live_boot == stats_of(sidecar)["boot_id"])
        fresh = leader.save(tokens(4, start=500), np.arange(4, 8))
        fresh.wait()
        # Plan ids start anywhere on each boot, so the stale id names no plan here either.
        assert fresh.plan.plan_id != stale.plan.plan_id
        with pytest.raises(SidecarUnavailable, match="restarted since"):
            follower.execute(stale.plan)  # its slots belong to the dead sidecar
        follower.execute(fresh.plan).wait()
        assert leader.lookup(tokens(4, start=500)) == 4 * sp.TOKENS_PER_BLOCK
        assert leader.lookup(tokens(4)) == 0
        s = stats_of(sidecar)
        assert s["plans_in_flight"] == 0 and s["tiers"]["cpu"]["used_blocks"] == 4
    finally:
        follower.close()
        leader.close()


def _mapped_segments(prefix: str) -> list[str]:
    """'inode path' of each shm segment of the sidecar instance whose
    segment names start with `prefix` that this process maps."""
    with open("/proc/self/maps") as maps:
        fields = [line.split(None, 5) for line in maps if f"/{prefix}." in line]
    return sorted({f"{f[4]} {f[5].strip()}" for f in fields})


def test_an_engine_making_only_lookups_unmaps_a_restarted_sidecars_old_pool(open_client):
    """After a restart the heartbeat registers with the new sidecar; the
    engine's next call of any kind (a lookup here: every lookup misses, so
    no load runs) maps the new pool and unmaps the old one, whose RAM the
    engine's mapping alone would keep."""
    s = Sidecar().start()
    client = open_client(s.endpoint, make_kv(12))
    try:
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        old = _mapped_segments(s.shm_prefix)
        assert old and not any("(deleted)" in m for m in old)
        s.kill()
        s.start()
        wait_for(lambda: len(stats_of(s)["engines"]) == 1)  # the heartbeat re-registered
        wait_for(lambda: client._link.live_boot == stats_of(s)["boot_id"])  # and read the reply
        assert client.lookup(tokens(2)) == 0
        now = _mapped_segments(s.shm_prefix)
        assert not any("(deleted)" in m for m in now) and now != old
    finally:
        client.close()
        s.stop()
        s.cleanup()


def test_a_load_whose_sidecar_restarted_before_its_wait_is_unavailable_not_an_error(sidecar):
    """A load's copies still queued (a GPU load) when the sidecar restarts
    and the heartbeat meets the new one: `wait()` must not report the plan
    to a sidecar that never made it."""
    with connect(sidecar.endpoint, make_kv(13), timeout=0.5) as client:
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        client._link.hot.close()  # a GPU load asks for a plan; a CPU one would not
        handle = client.load(tokens(2), np.arange(2, 4))
        assert handle.plan is not None
        handle._ack, handle._copies = None, [_Landed()]  # as a GPU load before its wait
        sidecar.kill()
        sidecar.start()
        wait_for(lambda: len(stats_of(sidecar)["engines"]) == 1)
        # The heartbeat met the new sidecar once it has read its reply, not
        # when the sidecar has registered it (a loaded machine sees the gap).
        wait_for(lambda: client._link.live_boot == stats_of(sidecar)["boot_id"])
        with pytest.raises(SidecarUnavailable, match="restarted since"):
            handle.wait()
        assert "unknown_plan" not in stats_of(sidecar)["errors"]


class _Landed:
    """A queued copy that has landed."""

    def synchronize(self) -> None:
        pass


def test_shm_gone_between_a_register_reply_and_its_mapping_is_unavailable(sidecar):
    with connect(sidecar.endpoint, make_kv(3)) as client:
        gone = r.RegisterReply(
            id=0,
            boot_id="x",
            segments=[f"/{sidecar.shm_prefix}.99"],
            segment_sizes=[4096],
            slot_stride=4096,
            num_slots=1,
            lease_seconds=10.0,
        )
        with pytest.raises(SidecarUnavailable, match="shared memory"):
            client._link._attach(gone)  # a restarted sidecar's reply, its segments already unlinked
        # The next call maps the live sidecar's segments again and goes on.
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK


def test_a_client_of_a_sidecar_that_never_came_waits_once():
    channel = Channel(f"ipc:///tmp/kvs-nobody-{os.getpid()}.sock", 2.0)
    try:
        for wait in (2.0, 0.0, 0.0):  # the slack is for a loaded machine, under one timeout
            start = time.monotonic()
            with pytest.raises(SidecarUnavailable):
                channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
            assert wait <= time.monotonic() - start < wait + 1.5
    finally:
        channel.close()


def test_a_request_abandoned_before_or_after_its_reply_came_has_its_plan_given_back(
    sidecar, open_client
):
    client = open_client(sidecar.endpoint, make_kv(13), hot_path=False)  # loads are plans
    assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    link, channel = client._link, client._link.channel
    frames = [p.keys_frame(client.block_keys(tokens(2))), p.ids_frame(np.arange(2))]
    first = channel.send(link.req(p.Load), frames)
    second = channel.send(link.req(p.Load), frames)
    reply, _ = channel.wait_reply(second)  # the first one's reply is read, and kept, on the way
    assert reply.hit_blocks == 2 and first in channel._early
    channel.abandon(first)  # its plan is given back now
    channel.abandon(second)  # answered and read: nothing more comes for it
    third = channel.send(link.req(p.Load), frames)
    channel.abandon(third)  # its reply is given back when a later call reads it
    wait_for(lambda: client.lookup(tokens(2)) >= 0 and stats_of(sidecar)["plans_in_flight"] == 1)
    # The second's plan is the caller's: it was taken, so it must be given back by hand.
    link.give_back(reply.plan_id)
    wait_for(lambda: client.lookup(tokens(2)) >= 0 and stats_of(sidecar)["plans_in_flight"] == 0)
    assert not channel.late and not channel._awaited and not channel._early
    assert client.delete(tokens(1)) == 2  # block 0 and the one below it: no lock left
