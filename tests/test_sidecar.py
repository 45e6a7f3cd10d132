"""The sidecar daemon and the engine shim, as real processes over real shm."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import sidecar_proc as sp
import torch
from sidecar_proc import Sidecar, connect, expected_blocks, make_kv, tokens

from bench.hugepages import HugePagesUnavailable, thp_tmpfs
from contract import protocol as p
from contract import replies as r
from engine_shim import SidecarError, SidecarUnavailable
from engine_shim.channel import Channel
from kvsidecar.cli import main as cli_main
from sidecar import runtime
from sidecar.config import load_config
from sidecar.server.server import Server

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def sidecar():
    s = Sidecar().start()
    yield s
    try:
        if s.proc is not None and s.proc.poll() is None:
            assert s.stop() == 0
        assert s.shm_segments() == [], "shm segments outlived the sidecar"
    finally:
        s.cleanup()


def run(fn, *args):
    with SPAWN.Pool(1) as pool:
        return pool.apply(fn, args)


def stats_of(s: Sidecar) -> dict:
    channel = Channel(s.endpoint, 2.0)
    try:
        reply, _ = channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        return reply.stats
    finally:
        channel.close()


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# ---- life cycle ------------------------------------------------------------------------


def test_serve_prints_where_it_listens_and_cleans_up_on_sigterm(sidecar):
    assert sidecar.endpoint in sidecar.banner and "CPU tier 4MiB" in sidecar.banner
    segments = sidecar.shm_segments()
    assert segments
    for name in segments:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sidecar.runtime_dir).st_mode) == 0o700
    assert sidecar.stop() == 0
    assert sidecar.shm_segments() == []
    assert os.listdir(sidecar.runtime_dir) == []  # socket and lock gone


def test_a_second_sidecar_with_the_same_name_refuses_to_start(sidecar):
    twin = Sidecar()
    twin.instance, twin.runtime_dir = sidecar.instance, sidecar.runtime_dir
    twin.args[1], twin.args[3] = sidecar.instance, f"runtime_dir={sidecar.runtime_dir}"
    with pytest.raises(RuntimeError, match="already running"):
        twin.start()
    assert sidecar.proc.poll() is None and stats_of(sidecar)["pid"] == sidecar.proc.pid


def test_a_lock_file_released_between_open_and_flock_is_not_taken_as_ours(tmp_path, monkeypatch):
    """A sidecar stopping (it unlinks its lock file, then drops the flock)
    while a new one has opened that file but not yet locked it: the new one
    must not own the instance through a lock on a removed file, or a third
    would lock a fresh file too, take the live one's segments for a dead
    sidecar's and remove them."""
    paths = runtime.InstancePaths(tmp_path, f"t{os.getpid()}-lockrace")
    first = runtime.InstanceLock(paths)
    real_flock, calls = runtime.fcntl.flock, []

    def flock_after_the_owner_released(fd: int, op: int) -> None:
        if not calls:
            first.release()  # the stopping owner: unlink, then close (unlock)
        calls.append(fd)
        real_flock(fd, op)

    monkeypatch.setattr(runtime.fcntl, "flock", flock_after_the_owner_released)
    second = runtime.InstanceLock(paths)
    monkeypatch.undo()
    try:
        assert len(calls) == 2  # the removed file's lock was dropped and the path locked anew
        assert paths.lock_path.read_text().strip() == str(os.getpid())
        with pytest.raises(runtime.InstanceRunning):
            runtime.InstanceLock(paths)
    finally:
        second.release()


def test_same_name_in_another_runtime_dir_leaves_the_first_sidecar_alone(sidecar):
    kv = make_kv(18)
    with connect(sidecar.endpoint, kv) as client:
        assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
    inodes = {name: os.stat(f"/dev/shm/{name}").st_ino for name in sidecar.shm_segments()}
    other = Sidecar()  # same instance name, its own runtime directory (lock scope)
    other.instance = other.args[1] = sidecar.instance
    other.endpoint = f"ipc://{other.runtime_dir}/{sidecar.instance}.sock"
    try:
        other.start()
        assert other.shm_segments() and not set(other.shm_segments()) & set(inodes)
        assert {n: os.stat(f"/dev/shm/{n}").st_ino for n in sidecar.shm_segments()} == inodes
        loaded, blocks = run(sp.load_worker, sidecar.endpoint, 3)
        assert loaded == 3 * sp.TOKENS_PER_BLOCK and blocks == expected_blocks(18, 3)
        assert other.stop() == 0
    finally:
        other.cleanup()


def test_a_sidecar_started_with_parent_pid_stops_when_its_owner_is_killed(tmp_path):
    ours, theirs = SPAWN.Pipe(duplex=False)
    owner = SPAWN.Process(target=sp.local_sidecar_owner, args=(str(tmp_path), theirs))
    owner.start()
    try:
        assert ours.poll(60), "the owner did not start its sidecar"
        pid, segments, socket_path = ours.recv()
        assert segments and os.path.exists(socket_path)
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        wait_for(gone)  # it drains and cleans up as on SIGTERM
    finally:
        if not gone():  # do not leave it running when the test fails
            os.kill(pid, signal.SIGKILL)
            for name in segments:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{name}")
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in segments)
    assert not os.path.exists(socket_path)
    # Its stdout went to the dead owner: the last line it prints must not fail.
    assert "Traceback" not in (tmp_path / "sidecar.log").read_text()


def test_parent_pid_that_is_not_the_parent_is_refused():
    stranger = subprocess.Popen(["sleep", "60"])  # alive, but not the sidecar's parent
    try:
        args = ["--parent-pid", str(stranger.pid), "--cpu-capacity", "4MiB"]
        out = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stranger.kill()
        stranger.wait()
    assert out.returncode == 2 and "is not this process's parent" in out.stderr


# ---- data path -----------------------------------------------------------------------------


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


def test_a_local_sidecar_in_a_deep_work_directory_puts_its_socket_in_a_short_one(tmp_path):
    from engine_shim.local_sidecar import IPC_PATH_MAX, LocalSidecar

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    local = LocalSidecar(deep, cpu_capacity="4MiB")
    socket_path = local.endpoint.removeprefix("ipc://")
    assert len(os.fsencode(socket_path)) <= IPC_PATH_MAX
    assert local.runtime_dir.parent == Path("/tmp")
    try:
        local.start()
        with connect(local.endpoint, make_kv(2)) as client:
            assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    finally:
        shutdown = local.close()
    assert shutdown == (0, [])
    assert not local.runtime_dir.exists()
    assert (deep / "sidecar.log").exists()


def test_a_refused_register_again_leaves_the_working_registration(sidecar):
    kv = make_kv(3)
    with connect(sidecar.endpoint, kv) as client:
        assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        assert client.registration == 1
        other = [layer.double() for layer in make_kv(None)]  # a layout this sidecar does not serve
        with pytest.raises(SidecarError) as info:
            client.register(other, **sp.MODEL)
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


def test_concurrent_saves_of_one_prefix_store_it_once(sidecar):
    barrier = SPAWN.Manager().Barrier(2)
    with SPAWN.Pool(2) as pool:
        results = [pool.apply_async(sp.save_worker, (sidecar.endpoint, 11, 6, barrier))] * 1
        results.append(pool.apply_async(sp.save_worker, (sidecar.endpoint, 11, 6, barrier)))
        assert [r.get(30) for r in results] == [6 * sp.TOKENS_PER_BLOCK] * 2
    cpu = stats_of(sidecar)["tiers"]["cpu"]
    assert cpu["cached_blocks"] == 6 and cpu["used_blocks"] == 6
    assert run(sp.load_worker, sidecar.endpoint, 6)[1] == expected_blocks(11, 6)


def test_a_block_is_invisible_until_its_save_completes(sidecar):
    kv = make_kv(5)
    with connect(sidecar.endpoint, kv) as saver, connect(sidecar.endpoint, make_kv(None)) as other:
        keys = saver._keys(tokens(3))
        channel = Channel(sidecar.endpoint, 2.0)
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


def test_tensor_parallel_op_completes_when_every_rank_reported(sidecar):
    manager = SPAWN.Manager()
    inbox, outbox = manager.Queue(), manager.Queue()
    with SPAWN.Pool(1) as pool:
        result = pool.apply_async(sp.tp_rank1_worker, (sidecar.endpoint, 21, inbox, outbox))
        leader = connect(sidecar.endpoint, make_kv(20), tp_size=2, tp_rank=0, engine_id="tp")
        assert outbox.get(timeout=30) == "registered"
        handle = leader.save(tokens(4), np.arange(4))
        handle.wait()
        probe = connect(sidecar.endpoint, make_kv(None), tp_size=2, engine_id="probe")
        assert probe.lookup(tokens(4)) == 0  # rank 1 has not copied its shard yet
        inbox.put(handle.plan)
        assert result.get(30) == "done"
        assert probe.lookup(tokens(4)) == 4 * sp.TOKENS_PER_BLOCK
        probe.close()
        leader.close()


# ---- failures -------------------------------------------------------------------------------


def test_an_engine_killed_mid_save_leaks_nothing(sidecar):
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=sp.hang_mid_save_worker, args=(sidecar.endpoint, 4, child))
    proc.start()
    assert parent.recv() == 4
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
    s = Sidecar(capacity="2MiB", lease=1.0).start()  # 8 slots of 256 KiB
    parent, child = SPAWN.Pipe()
    frozen = SPAWN.Process(target=sp.freeze_mid_save_worker, args=(s.endpoint, 4, child))
    frozen.start()
    try:
        assert parent.recv() == "frozen"
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
            assert parent.recv().startswith("SidecarError(")
        else:
            frozen.kill()
        frozen.join(10)
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


def test_a_sidecar_stalled_past_the_lease_does_not_expire_its_engines():
    """Stopped longer than a lease, the sidecar cannot have read the
    engines' heartbeats: on waking it renews their leases instead of
    dropping every engine (and rolling back plans they are copying)."""
    s = Sidecar(lease=1.0).start()
    try:
        client = connect(s.endpoint, make_kv(3))
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        s.proc.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        s.proc.send_signal(signal.SIGCONT)
        time.sleep(1.0)  # heartbeats flow again
        st = stats_of(s)
        assert st["expired_sessions"] == 0 and len(st["engines"]) == 1
        assert client.load(tokens(2), np.arange(2, 4)).wait() == 2 * sp.TOKENS_PER_BLOCK
        client.close()
    finally:
        s.proc.send_signal(signal.SIGCONT)
        assert s.stop() == 0
        s.cleanup()


@pytest.mark.parametrize("where", ["between_rounds", "in_the_stats_snapshot"])
def test_a_heartbeat_queued_through_a_short_stall_keeps_the_engines_lease(tmp_path, where):
    """The control loop stalls for under half a lease (between two rounds,
    or inside the stats snapshot that closes a round), and the engine's
    heartbeat sent meanwhile sits unread behind another request. Counting
    from the engine's last heartbeat read, its lease has run out; but the
    stall is a lapse of over a quarter lease, so every lease is renewed
    instead of this healthy engine being dropped."""
    config = load_config(
        env={},
        overrides={
            "instance": f"t{os.getpid()}-lapse",
            "runtime_dir": str(tmp_path),
            "cpu_capacity": 4 << 20,
            "lease_seconds": 1.0,
        },
    )
    server = Server(config)
    server.start()
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
    channel = Channel(server.endpoint, 2.0)
    client = connect(server.endpoint, make_kv(4))
    try:
        client._heartbeat.stop()  # this test sends the engine's heartbeat itself
        registered = time.monotonic()
        time.sleep(0.65)
        running.clear()
        assert paused.wait(2.0)
        stalled = time.monotonic()
        queued = [
            channel.send(p.Stats(v=p.PROTOCOL_VERSION, id=0)),
            channel.send(client._req(p.Heartbeat)),
        ]
        time.sleep(max(0.45 - (time.monotonic() - stalled), registered + 1.1 - time.monotonic()))
        running.set()
        for rid in queued:
            channel.wait_reply(rid)
        assert server.num_lapses >= 1
        assert server.handlers.engines.num_expired == 0
        assert client.session in server.handlers.engines.sessions
    finally:
        stop.set()
        running.set()
        thread.join(5.0)
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
        assert parent.poll(30) and parent.recv()
        assert stats_of(s)["expired_sessions"] == 0
        os.kill(engine.pid, signal.SIGSTOP)  # alive, but silent
        time.sleep(1.0)  # the sidecar idles: nothing else wakes its loop
        st = stats_of(s)
        assert st["expired_sessions"] == 1 and st["engines"] == []
    finally:
        engine.kill()
        engine.join(10)
        assert s.stop() == 0
        s.cleanup()


def test_a_stalled_sidecar_costs_one_timeout_and_its_late_replies_are_dropped(sidecar):
    client = connect(sidecar.endpoint, make_kv(11), timeout=0.3)
    assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert client.lookup(tokens(2)) == 0
        with pytest.raises(SidecarUnavailable, match=r"did not answer within 0\.3 s"):
            client.load(tokens(2), np.arange(2))
        assert time.monotonic() - start < 2 * 0.3 + 1.0
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    # The stalled lookup and load are answered now; those replies come before
    # the next one and must not be taken for it.
    assert client.lookup(tokens(3)) == 2 * sp.TOKENS_PER_BLOCK
    assert client.lookup(tokens(1)) == sp.TOKENS_PER_BLOCK
    # The late load's plan, which no copy will ever run, was given back: its
    # locks are gone, so the blocks can be deleted.
    wait_for(lambda: stats_of(sidecar)["plans_in_flight"] == 0)
    assert client.delete(tokens(1)) == 2  # block 0 and the one below it
    client.close()


def test_a_save_answered_after_its_timeout_is_given_back(sidecar):
    client = connect(sidecar.endpoint, make_kv(12), timeout=0.3)
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(SidecarUnavailable):
            client.save(tokens(3), np.arange(3))
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    assert client.lookup(tokens(3)) == 0  # reads the late save reply and cancels its plan
    wait_for(lambda: stats_of(sidecar)["plans_in_flight"] == 0)
    assert stats_of(sidecar)["tiers"]["cpu"]["used_blocks"] == 0
    # The prefix is not stuck "in flight": saving it again stores it.
    assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
    assert client.lookup(tokens(3)) == 3 * sp.TOKENS_PER_BLOCK
    client.close()


def test_engines_carry_on_when_the_sidecar_dies_and_find_it_again(sidecar):
    client = connect(sidecar.endpoint, make_kv(9), timeout=0.5)
    assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    old_segments = sidecar.shm_segments()
    sidecar.proc.kill()
    sidecar.proc.wait()
    start = time.monotonic()
    assert client.lookup(tokens(2)) == 0
    with pytest.raises(SidecarUnavailable):
        client.load(tokens(2), np.arange(2))
    with pytest.raises(SidecarUnavailable):
        client.save(tokens(2), np.arange(2))
    assert time.monotonic() - start < 3 * 0.5 + 1.0
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
    from engine_shim.client import _plan_ops

    keys = client.block_keys(tokens(n))
    reply, arrays = client._call(
        client._req(p.Save), [p.keys_frame(keys), p.ids_frame(np.arange(n))]
    )
    return _plan_ops(reply, arrays, "save")


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
            follower._fail(plan, RuntimeError("rank 1's copy failed"))
        else:
            follower._give_back(plan.plan_id)
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
            follower._fail(plan, RuntimeError("rank 1's copy failed"))
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
            leader._fail(plan, RuntimeError("rank 0's copy failed"))
        else:
            leader._give_back(plan.plan_id)
        wait_for(lambda: stats_of(s)["plans_in_flight"] == 0)
        st = stats_of(s)
        assert st["orphaned_plans"] == 0 and st["tiers"]["cpu"]["used_blocks"] == 0
    finally:
        leader.close()
        follower.close()
        assert s.stop() == 0
        s.cleanup()


def test_a_load_parked_for_a_cpu_slot_is_retried_when_a_save_becomes_an_orphan(tmp_path):
    """The rollback of an orphaned save unlocks the prefix it had locked,
    which a load waiting for a CPU slot may evict: it is served then, not
    when the last writer reports."""
    import threading

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

        def load() -> None:
            handle = others[0].load(tokens(4, start=10_000), np.arange(8, 12))
            others[1].execute(handle.plan).wait()
            assert handle.wait() == 4 * sp.TOKENS_PER_BLOCK
            served.append(time.monotonic())

        waiter = threading.Thread(target=load)
        waiter.start()
        time.sleep(0.5)  # parked: no CPU slot to stage X into
        follower._fail(plan, RuntimeError("rank 1's copy failed"))
        failed = time.monotonic()
        waiter.join(5)
        assert served and served[0] - failed < 3, "the load waited for rank 0"
        with pytest.raises(SidecarError):
            leader.execute(plan).wait()
    finally:
        for client in (leader, follower, *others):
            client.close()
        assert s.stop() == 0
        s.cleanup()


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


def _mapped_segments() -> list[str]:
    """'inode path' of each kvsidecar shm segment this process maps."""
    with open("/proc/self/maps") as maps:
        fields = [line.split(None, 5) for line in maps if "kvsidecar." in line]
    return sorted({f"{f[4]} {f[5].strip()}" for f in fields})


def test_an_engine_making_only_lookups_unmaps_a_restarted_sidecars_old_pool(tmp_path):
    """After a restart the heartbeat registers with the new sidecar; the
    engine's next call of any kind (a lookup here: every lookup misses, so
    no load runs) maps the new pool and unmaps the old one, whose RAM the
    engine's mapping alone would keep."""
    s = Sidecar(lease=0.6).start()
    client = connect(s.endpoint, make_kv(12))
    try:
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        old = _mapped_segments()
        assert old and not any("(deleted)" in m for m in old)
        s.kill()
        s.start()
        wait_for(lambda: len(stats_of(s)["engines"]) == 1)  # the heartbeat re-registered
        assert client.lookup(tokens(2)) == 0
        now = _mapped_segments()
        assert not any("(deleted)" in m for m in now) and now != old
    finally:
        client.close()
        s.stop()


def test_a_load_whose_sidecar_restarted_before_its_wait_is_unavailable_not_an_error(sidecar):
    """A load's copies still queued (a GPU load) when the sidecar restarts
    and the heartbeat meets the new one: `wait()` must not report the plan
    to a sidecar that never made it."""
    with connect(sidecar.endpoint, make_kv(13), timeout=0.5) as client:
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        handle = client.load(tokens(2), np.arange(2, 4))
        assert handle.plan is not None
        handle._ack, handle._copies = None, [_Landed()]  # as a GPU load before its wait
        sidecar.kill()
        sidecar.start()
        wait_for(lambda: len(stats_of(sidecar)["engines"]) == 1)
        with pytest.raises(SidecarUnavailable, match="restarted since"):
            handle.wait()
        assert "unknown_plan" not in stats_of(sidecar)["errors"]


class _Landed:
    """A queued copy that has landed."""

    def synchronize(self) -> None:
        pass


def test_a_closed_client_says_so_and_registers_nothing(sidecar):
    client = connect(sidecar.endpoint, make_kv(14))
    client.close()
    for call in (lambda: client.lookup(tokens(1)), lambda: client.save(tokens(1), [0])):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    with pytest.raises(RuntimeError, match="closed"):
        client.register(make_kv(14), **sp.MODEL)
    assert client._register_args is None and stats_of(sidecar)["engines"] == []


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
            client._attach(gone)  # a restarted sidecar's reply, its segments already unlinked
        # The next call maps the live sidecar's segments again and goes on.
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK


def test_cpu_tier_on_a_huge_page_mount_and_its_leftovers_cleaned():
    try:
        mount = thp_tmpfs(8 << 20)
        path = mount.__enter__()
    except HugePagesUnavailable as err:
        pytest.skip(f"no huge=always tmpfs here: {err}")
    s = Sidecar("--set", f"shm_dir={path}")
    try:
        s.start()
        assert run(sp.save_worker, s.endpoint, 4, 3) == 3 * sp.TOKENS_PER_BLOCK
        assert run(sp.load_worker, s.endpoint, 3)[1] == expected_blocks(4, 3)
        cpu = stats_of(s)["tiers"]["cpu"]
        assert cpu["directory"] == path and cpu["page_kind"] in ("thp", "4k")
        assert f"({cpu['page_kind']} pages)" in s.banner
        names = sorted(os.listdir(path))
        assert names and all(n.startswith(s.shm_prefix + ".") for n in names)
        s.kill()  # SIGKILL leaves the segment files; the next start removes them
        stale = {n: os.stat(os.path.join(path, n)).st_ino for n in names}
        s.start()
        fresh = {n: os.stat(os.path.join(path, n)).st_ino for n in os.listdir(path)}
        assert fresh and not set(fresh.items()) & set(stale.items()), "stale segments reused"
        assert s.stop() == 0
        assert os.listdir(path) == []
    finally:
        s.kill()
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        s.cleanup()
        mount.__exit__(None, None, None)


def test_refusals_are_structured_and_change_nothing(sidecar):
    a = connect(sidecar.endpoint, make_kv(1), engine_id="a")
    b = connect(sidecar.endpoint, make_kv(None), engine_id="b")
    channel = Channel(sidecar.endpoint, 2.0)
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
    with pytest.raises(SidecarError) as info:
        connect(sidecar.endpoint, make_kv(None, num_blocks=8)[:1], engine_id="c")
    assert info.value.code == "layout_mismatch"
    for c in (a, b):
        c.close()
    channel.close()


def test_a_negative_pid_is_refused_and_the_sidecar_lives_on(sidecar):
    channel = Channel(sidecar.endpoint, 2.0)
    try:
        kv = make_kv(None)
        probe = connect(sidecar.endpoint, kv, engine_id="probe")
        request = p.Register(
            v=1,
            id=0,
            session="neg",
            engine_id="neg",
            kv=probe._register_args["kv"],
            pid=-1,
            pid_ns=probe._register_args["pid_ns"],
        )
        with pytest.raises(SidecarError) as info:
            channel.call(request)
        assert info.value.code == "bad_value"
        time.sleep(1.2)  # past a lease check
        assert sidecar.proc.poll() is None
        assert [e["engine_id"] for e in stats_of(sidecar)["engines"]] == ["probe"]
        probe.close()
    finally:
        channel.close()


def test_registering_again_as_another_engine_or_rank_leaves_nothing_behind(sidecar):
    channel = Channel(sidecar.endpoint, 2.0)
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


def test_a_tp_engine_missing_a_rank_gets_no_plans(sidecar):
    leader = connect(sidecar.endpoint, make_kv(14), engine_id="tp", tp_size=2, tp_rank=0)
    try:
        with pytest.raises(SidecarError) as info:
            leader.save(tokens(2), np.arange(2))
        assert info.value.code == "ranks_missing"
        follower = connect(sidecar.endpoint, make_kv(15), engine_id="tp", tp_size=2, tp_rank=1)
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


def test_tcp_endpoint():
    port = sp.free_port()
    s = Sidecar("--endpoint", f"tcp://127.0.0.1:{port}").start()
    try:
        assert s.endpoint in s.banner
        with connect(s.endpoint, make_kv(6)) as client:
            assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
        loaded, blocks = run(sp.load_worker, s.endpoint, 3)
        assert loaded == 3 * sp.TOKENS_PER_BLOCK and blocks == expected_blocks(6, 3)
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_an_ipc_endpoint_is_never_taken_from_a_live_sidecar_and_is_removed_at_stop(tmp_path):
    endpoint = f"ipc://{tmp_path}/shared.sock"
    first = Sidecar("--endpoint", endpoint)
    second = Sidecar("--endpoint", endpoint)  # another instance name, same socket path
    try:
        first.start()
        with pytest.raises(RuntimeError, match="served by another live process"):
            second.start()
        assert stats_of(first)["pid"] == first.proc.pid
        assert first.stop() == 0
        assert not (tmp_path / "shared.sock").exists()
        second.start()  # the path is free again
        assert second.stop() == 0
        (tmp_path / "shared.sock").write_text("not a socket")
        with pytest.raises(RuntimeError, match="exists and is not a socket"):
            second.start()
        assert (tmp_path / "shared.sock").read_text() == "not a socket"
    finally:
        first.cleanup()
        second.cleanup()


def test_a_start_up_failure_is_one_line_not_a_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--cpu-capacity", "4MiB", "--instance", f"t{os.getpid()}-port"]
        out = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "serve", *args, "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1
    assert "kvsidecar: cannot start:" in out.stderr and "Traceback" not in out.stderr


def test_a_bad_flag_value_is_blamed_on_that_flag(capsys):
    assert cli_main(["serve", "--cpu-capacity", "abc"]) == 2
    assert "configuration error: --cpu-capacity: cpu_capacity: 'abc' is not a size" in (
        capsys.readouterr().err
    )


def test_a_client_of_a_sidecar_that_never_came_waits_once():
    channel = Channel(f"ipc:///tmp/kvs-nobody-{os.getpid()}.sock", 0.5)
    try:
        for wait in (0.5, 0.0, 0.0):
            start = time.monotonic()
            with pytest.raises(SidecarUnavailable):
                channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
            assert wait <= time.monotonic() - start < wait + 0.45
    finally:
        channel.close()


def test_busy_polling_loop_serves_and_stops():
    s = Sidecar("--set", "busy_poll_us=5000").start()
    try:
        with connect(s.endpoint, make_kv(8)) as client:
            for n in (1, 2, 3):  # back to back, inside the busy-poll window
                assert client.save(tokens(n), np.arange(n)).wait() == n * sp.TOKENS_PER_BLOCK
        loaded, blocks = run(sp.load_worker, s.endpoint, 3)
        assert loaded == 3 * sp.TOKENS_PER_BLOCK and blocks == expected_blocks(8, 3)
        assert s.stop() == 0  # SIGTERM is honoured while spinning too
    finally:
        s.cleanup()


# ---- tools ---------------------------------------------------------------------------------------


def test_status_stats_and_metrics(capsys):
    port = sp.free_port()
    metrics = Sidecar("--metrics-port", str(port)).start()
    args = ["--instance", metrics.instance, "--set", f"runtime_dir={metrics.runtime_dir}"]
    try:
        with connect(metrics.endpoint, make_kv(2)) as client:
            client.save(tokens(2), np.arange(2)).wait()
            client.lookup(tokens(4))
        assert cli_main(["status", *args]) == 0
        out = capsys.readouterr().out
        assert "hit ratio 0.500" in out and "2/" in out
        assert cli_main(["stats", "--json", *args]) == 0
        assert '"hit_ratio": 0.5' in capsys.readouterr().out
        time.sleep(1.2)  # the snapshot the metrics thread reads is refreshed every second
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b'kvsidecar_hit_ratio{tier="cpu"} 0.5' in text
        assert metrics.stop() == 0
        assert cli_main(["status", *args, "--timeout", "0.3"]) == 1
    finally:
        metrics.cleanup()
