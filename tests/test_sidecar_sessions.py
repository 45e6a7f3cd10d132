"""Engine sessions on a real sidecar: register and register again, closed
clients, leases and heartbeats (through stalls of the sidecar or the
engine), and tensor-parallel engines whose ranks register one by one."""

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
    expected_blocks,
    make_kv,
    stats_of,
    tokens,
    wait_for,
)

from contract import protocol as p
from engine_shim import SidecarError
from engine_shim.channel import Channel
from sidecar.config import load_config
from sidecar.server.server import Server


def test_a_refused_register_again_leaves_the_working_registration(sidecar):
    kv = make_kv(3)
    with connect(sidecar.endpoint, kv) as client:
        assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        assert client.registration == 1
        # A block of 32 MiB does not fit the 4 MiB CPU tier: refused.
        other = [torch.zeros(2, 2, sp.TOKENS_PER_BLOCK, 2, 1 << 16) for _ in range(2)]
        with pytest.raises(SidecarError) as info:
            client.register(other, **{**sp.MODEL, "head_dim": 1 << 16})
        assert info.value.code == "layout_mismatch"
        assert client.registration == 1
        # still the first registration: same keys, same tensors, same copier
        assert client.lookup(tokens(3, tail=1)) == 3 * sp.TOKENS_PER_BLOCK
        for layer in kv:
            layer.zero_()
        assert client.load(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        assert [layer[:3].numpy().tobytes() for layer in kv] == expected_blocks(3, 3)
        client.register(make_kv(None), **sp.MODEL)  # an accepted one counts
        assert client.registration == 2


def test_register_refuses_tensors_that_contradict_its_geometry_before_asking(sidecar):
    from engine_shim import KVClient

    kv = make_kv(None)  # [blocks, 2, tokens_per_block, 2 heads, head dim 8]
    client = KVClient.connect(sidecar.endpoint, timeout=2.0)
    try:
        for wrong in ({"tokens_per_block": 32}, {"num_kv_heads": 4}, {"head_dim": 4}):
            with pytest.raises(ValueError, match="register\\(\\) was told"):
                client.register(kv, **{**sp.MODEL, **wrong})
        assert client.registration == 0
        assert stats_of(sidecar)["engines"] == []
        flat = [layer.reshape(layer.shape[0], -1) for layer in kv]  # free-form planes pass
        client.register(flat, **sp.MODEL)
        assert client.registration == 1
    finally:
        client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.stats()


def test_a_closed_client_says_so_and_registers_nothing(sidecar):
    client = connect(sidecar.endpoint, make_kv(14))
    client.close()
    for call in (lambda: client.lookup(tokens(1)), lambda: client.save(tokens(1), [0])):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    with pytest.raises(RuntimeError, match="closed"):
        client.register(make_kv(14), **sp.MODEL)
    assert client._link.register_args is None and stats_of(sidecar)["engines"] == []


def test_a_negative_pid_is_refused_and_the_sidecar_lives_on(sidecar):
    channel = Channel(sidecar.endpoint, 30.0)
    try:
        kv = make_kv(None)
        probe = connect(sidecar.endpoint, kv, engine_id="probe")
        request = p.Register(
            v=1,
            id=0,
            session="neg",
            engine_id="neg",
            kv=probe._link.register_args["kv"],
            pid=-1,
            pid_ns=probe._link.register_args["pid_ns"],
        )
        with pytest.raises(SidecarError) as info:
            channel.call(request)
        assert info.value.code == "bad_value"
        up = stats_of(sidecar)["uptime_seconds"]  # past a lease check (at most 1 s apart)
        wait_for(lambda: stats_of(sidecar)["uptime_seconds"] > up + 1.2)
        assert sidecar.proc.poll() is None
        assert [e["engine_id"] for e in stats_of(sidecar)["engines"]] == ["probe"]
        probe.close()
    finally:
        channel.close()


def test_registering_again_as_another_engine_or_rank_leaves_nothing_behind(sidecar):
    channel = Channel(sidecar.endpoint, 30.0)
    client = connect(sidecar.endpoint, make_kv(13))
    try:
        keys = client.block_keys(tokens(2))
        save = p.Save(v=1, id=0, session=client.session)
        channel.call(save, [p.keys_frame(keys), p.ids_frame(np.arange(2))])  # never completed
        assert stats_of(sidecar)["plans_in_flight"] == 1
        client.register(make_kv(13), **sp.MODEL)  # a fresh engine id: its old place goes
        s = stats_of(sidecar)
        assert s["plans_in_flight"] == 0 and s["tiers"]["cpu"]["used_blocks"] == 0
        assert len(s["engines"]) == 1
    finally:
        client.close()
        channel.close()
    wait_for(lambda: stats_of(sidecar)["engines"] == [])


def test_tensor_parallel_op_completes_when_every_rank_reported(sidecar, open_client):
    with SPAWN.Manager() as manager, SPAWN.Pool(1) as pool:
        inbox, outbox = manager.Queue(), manager.Queue()
        result = pool.apply_async(sp.tp_rank1_worker, (sidecar.endpoint, 21, inbox, outbox))
        leader = open_client(sidecar.endpoint, make_kv(20), tp_size=2, tp_rank=0, engine_id="tp")
        # rank 1 is a spawned process importing torch: slow on a loaded machine
        assert outbox.get(timeout=sp.DEADLINE) == "registered"
        handle = leader.save(tokens(4), np.arange(4))
        handle.wait()
        probe = open_client(sidecar.endpoint, make_kv(None), tp_size=2, engine_id="probe")
        assert probe.lookup(tokens(4)) == 0  # rank 1 has not copied its shard yet
        inbox.put(handle.plan)
        assert result.get(sp.DEADLINE) == "done"
        assert probe.lookup(tokens(4)) == 4 * sp.TOKENS_PER_BLOCK
        probe.close()
        leader.close()


def test_a_tp_engine_missing_a_rank_gets_no_plans(sidecar, open_client):
    leader = connect(sidecar.endpoint, make_kv(14), engine_id="tp", tp_size=2, tp_rank=0)
    try:
        with pytest.raises(SidecarError) as info:
            leader.save(tokens(2), np.arange(2))
        assert info.value.code == "ranks_missing"
        follower = open_client(sidecar.endpoint, make_kv(15), engine_id="tp", tp_size=2, tp_rank=1)
        handle = leader.save(tokens(2), np.arange(2))
        handle.wait()
        follower.execute(handle.plan).wait()
        assert leader.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
        follower.close()  # rank 1 leaves: nothing more can complete
        for call in (leader.save, leader.load):
            with pytest.raises(SidecarError) as info:
                call(tokens(3), np.arange(3))
            assert info.value.code == "ranks_missing"
        s = stats_of(sidecar)
        assert s["plans_in_flight"] == 0 and s["tiers"]["cpu"]["used_blocks"] == 2
        # The same session registering as another rank of its engine leaves its old rank.
        leader.register(make_kv(14), **sp.MODEL, engine_id="tp", tp_size=2, tp_rank=1)
        assert [(e["engine_id"], e["ranks"]) for e in stats_of(sidecar)["engines"]] == [("tp", [1])]
    finally:
        leader.close()


def test_a_sidecar_stalled_past_the_lease_does_not_expire_its_engines(open_client):
    """Stopped longer than a lease, the sidecar cannot have read the
    engines' heartbeats: on waking it renews their leases instead of
    dropping every engine (and rolling back plans they are copying)."""
    lease = 2.0
    s = Sidecar(lease=lease).start()
    try:
        client = open_client(s.endpoint, make_kv(3))
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        s.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.5 * lease)  # at least that long: longer is a longer stall
        s.proc.send_signal(signal.SIGCONT)
        # Its first round awake counts the stall and runs a lease check; then
        # a lease of its own time goes by: heartbeats flow again.
        wait_for(lambda: stats_of(s)["loop_lapses"] >= 1)
        awake = stats_of(s)["uptime_seconds"]
        wait_for(lambda: stats_of(s)["uptime_seconds"] > awake + lease)
        st = stats_of(s)
        assert st["expired_sessions"] == 0 and len(st["engines"]) == 1
        assert client.load(tokens(2), np.arange(2, 4)).wait() == 2 * sp.TOKENS_PER_BLOCK
        client.close()
    finally:
        s.proc.send_signal(signal.SIGCONT)
        assert s.stop() == 0
        s.cleanup()


def in_process_server(tmp_path, name: str, **settings) -> Server:
    """A started sidecar server in this process, its loop run by the test."""
    overrides = {
        "instance": f"t{os.getpid()}-{name}",
        "runtime_dir": str(tmp_path),
        "cpu_capacity": 4 << 20,
        **settings,
    }
    server = Server(load_config(env={}, overrides=overrides))
    server.start()
    return server


@pytest.mark.parametrize("where", ["between_rounds", "in_the_stats_snapshot"])
def test_a_heartbeat_queued_through_a_short_stall_keeps_the_engines_lease(tmp_path, where):
    """The control loop stalls for under half a lease (between two rounds,
    or inside the stats snapshot that closes a round), and the engine's
    heartbeat sent meanwhile sits unread behind another request. Counting
    from the engine's last heartbeat read, its lease has run out; but the
    stall is a lapse of over a quarter lease, so every lease is renewed
    instead of this healthy engine being dropped. The lease is long (6 s)
    against the scheduling delays of a loaded machine, and the stall is
    timed from the engine's last heartbeat as the server recorded it."""
    lease = 6.0
    server = in_process_server(tmp_path, "lapse", lease_seconds=lease)
    running, paused, stop = threading.Event(), threading.Event(), threading.Event()
    running.set()

    def hold() -> None:
        if not running.is_set():
            paused.set()
            running.wait()

    def stats_after_a_stall() -> dict:
        hold()
        return Server.stats(server)

    if where == "in_the_stats_snapshot":
        server.stats = stats_after_a_stall  # type: ignore[method-assign]

    def loop() -> None:
        while not stop.is_set():
            if where == "between_rounds":
                hold()
            server.poll_once()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    channel = Channel(server.endpoint, 30.0)
    client = connect(server.endpoint, make_kv(4))
    try:
        heartbeat = client._link.heartbeat
        heartbeat.stop()  # this test sends the engine's heartbeat itself
        heartbeat._thread.join()  # no beat of its own still on the way
        channel.call(client._link.req(p.Heartbeat))
        seen = server.handlers.engines.sessions[client.session].last_seen
        # The stall starts late in the lease (a lease check just before it
        # must still find the engine within it: 2.4 s to spare) ...
        time.sleep(max(0.0, seen + 0.6 * lease - time.monotonic()))
        running.clear()
        assert paused.wait(sp.DEADLINE)
        stalled = time.monotonic()
        queued = [
            channel.send(p.Stats(v=p.PROTOCOL_VERSION, id=0)),
            channel.send(client._link.req(p.Heartbeat)),
        ]
        # ... lasts over a quarter lease (about half), and ends past the lease.
        time.sleep(
            max(0.35 * lease - (time.monotonic() - stalled), seen + 1.1 * lease - time.monotonic())
        )
        running.set()
        for rid in queued:
            channel.wait_reply(rid)
        assert server.num_lapses >= 1
        assert server.handlers.engines.num_expired == 0
        assert client.session in server.handlers.engines.sessions
    finally:
        stop.set()
        running.set()
        thread.join(sp.DEADLINE)
        channel.close()
        client.close()
        server.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(server.paths.shm_prefix + ".")]


def test_with_a_lease_shorter_than_the_idle_wait_a_frozen_engine_still_expires():
    """The loop waits at most an eighth of a lease, so a 0.1 s lease is not
    taken for a stall on every round (renewing every lease forever)."""
    s = Sidecar(lease=0.1).start()
    parent, child = SPAWN.Pipe()
    engine = SPAWN.Process(target=sp.idle_engine_worker, args=(s.endpoint, child))
    engine.start()
    try:
        assert parent.poll(sp.DEADLINE) and parent.recv()
        # Heartbeats 33 ms apart may miss a 0.1 s lease on a loaded machine
        # before the freeze (the engine then registers again): count from here.
        before = stats_of(s)["expired_sessions"]
        os.kill(engine.pid, signal.SIGSTOP)  # alive, but silent

        def expired() -> bool:
            st = stats_of(s)
            return st["expired_sessions"] > before and st["engines"] == []

        # The sidecar idles (nothing else wakes its loop) but for a stats
        # request a second: ten leases of idle rounds between two.
        wait_for(expired, interval=1.0)
        st = stats_of(s)
        assert st["expired_sessions"] > before and st["engines"] == []
    finally:
        engine.kill()
        engine.join(10)
        assert s.stop() == 0
        s.cleanup()


def test_a_reply_that_cannot_be_encoded_is_an_internal_error_not_a_crash(tmp_path):
    """A reply the codec refuses (here a figure past 2**64, as a quota of
    2**64 bytes made before quotas were bounded) took the daemon down."""
    server = in_process_server(tmp_path, "encode")
    figures = server.handlers._figures
    server.handlers._figures = lambda: {**figures(), "too_big": 1 << 70}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            server.poll_once()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    channel = Channel(server.endpoint, 30.0)
    try:
        with pytest.raises(SidecarError, match="internal"):
            channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        server.handlers._figures = figures
        reply, _ = channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        assert reply.stats["errors"]["internal"] == 1
    finally:
        stop.set()
        thread.join(sp.DEADLINE)
        channel.close()
        server.close()


def test_the_policy_learning_waits_while_a_request_is_ready(tmp_path):
    """`auto`'s shadows are worked off between requests: never while one is
    waiting to be read (each lookup of a closed loop waited for them: the
    4-client lookup rate fell below half the raw ping-pong's)."""
    server = in_process_server(tmp_path, "pacer", eviction_policy="auto")
    paced_while_waiting: list[bool] = []
    run = server._pacer.run

    def watched(work):
        paced_while_waiting.append(server.parts.transport.request_waiting())
        return run(work)

    server._pacer.run = watched  # type: ignore[method-assign]
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            server.poll_once()

    def serving() -> threading.Thread:
        stop.clear()
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread

    client = None
    thread = serving()
    try:
        client = connect(server.endpoint, make_kv(1), hot_path=False)
        client.save(tokens(8), np.arange(8)).wait()
        client._link.heartbeat.stop()  # nothing but the lookups below arrives
        stop.set()
        thread.join(sp.DEADLINE)
        channel, keys = client._link.channel, client._keys(tokens(8)).tobytes()
        sent = [channel.send(client._lookup_request, [keys]) for _ in range(200)]
        paced_while_waiting.clear()
        thread = serving()  # 200 lookups queued: the loop finds them waiting
        for rid in sent:
            channel.wait_reply(rid)
        wait_for(lambda: len(paced_while_waiting) > 0)  # the round after the last
        assert not any(paced_while_waiting)
    finally:
        stop.set()
        thread.join(sp.DEADLINE)
        if client is not None:
            client.close()
        server.close()
