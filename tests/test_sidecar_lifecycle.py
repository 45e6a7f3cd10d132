"""Sidecar life cycle, as real processes: start and stop, the instance lock,
the runtime directory, the owner (parent pid), endpoints, start-up errors,
and the status/stats/metrics tools."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import sidecar_proc as sp
from sidecar_proc import (
    SPAWN,
    Sidecar,
    connect,
    expected_blocks,
    make_kv,
    run,
    stats_of,
    tokens,
    wait_for,
)

from bench.hugepages import HugePagesUnavailable, thp_tmpfs
from kvsidecar.cli import main as cli_main
from sidecar import runtime


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
    twin = Sidecar(instance=sidecar.instance, runtime_dir=sidecar.runtime_dir)
    with pytest.raises(RuntimeError, match="already running"):
        twin.start()
    assert sidecar.proc.poll() is None and stats_of(sidecar)["pid"] == sidecar.proc.pid


def test_a_live_sidecar_whose_lock_file_was_removed_loses_nothing_to_a_second(sidecar):
    """A /tmp cleaner removed the live sidecar's lock file: a second start
    on its name takes a new lock, and must then see the live socket and
    refuse before removing anything (it removed the live one's segments,
    hot index and admin token, and only then failed at the bind)."""
    kv = make_kv(4)
    client = connect(sidecar.endpoint, kv)
    try:
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        segments = sorted(n for n in os.listdir("/dev/shm") if sidecar.shm_prefix in n)
        files = sorted(os.listdir(sidecar.runtime_dir))
        twin = Sidecar(instance=sidecar.instance, runtime_dir=sidecar.runtime_dir)
        with sp.frozen(sidecar):  # it would make its lock file again within a second
            os.unlink(Path(sidecar.runtime_dir) / f"{sidecar.instance}.lock")
            with pytest.raises(RuntimeError, match=r"served by another live process.*lock file"):
                twin.start()
            assert sorted(n for n in os.listdir("/dev/shm") if sidecar.shm_prefix in n) == segments
            kept = [name for name in files if name.endswith((".sock", ".admin"))]
            assert sorted(os.listdir(sidecar.runtime_dir)) == kept
        lock = Path(sidecar.runtime_dir) / f"{sidecar.instance}.lock"
        wait_for(lock.exists)  # made again by the live sidecar
        other = connect(sidecar.endpoint, make_kv(4))  # maps the live segments
        try:
            assert other.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
        finally:
            other.close()
        assert client.lookup(tokens(2)) == 2 * sp.TOKENS_PER_BLOCK
    finally:
        client.close()


def test_a_held_lock_makes_its_removed_file_again_and_never_raises(tmp_path, caplog):
    paths = runtime.InstancePaths(tmp_path / "run", f"t{os.getpid()}-keep")
    paths.runtime_dir.mkdir()
    lock = runtime.InstanceLock(paths)
    try:
        paths.lock_path.unlink()
        lock.keep()
        assert paths.lock_path.read_text().strip() == str(os.getpid())
        with pytest.raises(runtime.InstanceRunning):
            runtime.InstanceLock(paths)
        # Another process took the name while the file was gone: said once, and
        # its file is not ours to remove.
        paths.lock_path.unlink()
        other = runtime.InstanceLock(paths)
        with caplog.at_level("ERROR", logger="kvsidecar"):
            lock.keep()
            lock.keep()
        assert [r.getMessage() for r in caplog.records].count(
            f"the lock file {paths.lock_path} was removed and another process locked it: "
            "a second sidecar of it may be starting"
        ) == 1
        lock.release()
        assert paths.lock_path.exists()
        other.release()
        # The directory went too: nothing raised.
        lock = runtime.InstanceLock(paths)
        shutil.rmtree(paths.runtime_dir)
        lock.keep()
        assert not paths.runtime_dir.exists()
    finally:
        lock.release()


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
    other = Sidecar(instance=sidecar.instance)  # its own runtime directory (lock scope)
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


def test_a_local_sidecar_in_a_deep_work_directory_puts_its_socket_in_a_short_one(tmp_path):
    from engine_shim.local_sidecar import IPC_PATH_MAX, LocalSidecar

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    local = LocalSidecar(deep, cpu_capacity="4MiB")
    try:  # its own directory in /tmp is removed by close(), even if a check fails
        socket_path = local.endpoint.removeprefix("ipc://")
        assert len(os.fsencode(socket_path)) <= IPC_PATH_MAX
        assert local.runtime_dir.parent == Path("/tmp")
        local.start()
        with connect(local.endpoint, make_kv(2)) as client:
            assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    finally:
        shutdown = local.close()
    assert shutdown == (0, [])
    assert not local.runtime_dir.exists()
    assert (deep / "sidecar.log").exists()


def test_a_killed_local_sidecar_leaves_no_segment_its_hot_index_included(tmp_path):
    """`LocalSidecar.close()` after a death its stop did not see (the OOM
    killer, a stop that timed out): every segment of the instance goes, the
    hot index's too (it was left in /dev/shm)."""
    from engine_shim.local_sidecar import LocalSidecar

    local = LocalSidecar(tmp_path, cpu_capacity="4MiB")
    try:
        local.start()
        with connect(local.endpoint, make_kv(2)) as client:
            assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
        before = local.shm_segments()
        assert any("-hot." in name for name in before)
        local.kill()
    finally:
        shutdown = local.close()
    assert sorted(name.lstrip("/") for name in shutdown.leftovers) == before
    assert local.shm_segments() == []
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(local.shm_prefix)]


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


@pytest.mark.parametrize("key", ["endpoint", "events_endpoint", "events_resync_endpoint"])
def test_an_ipc_endpoint_is_never_taken_from_a_live_sidecar_and_is_removed_at_stop(key, tmp_path):
    """The event endpoints too: libzmq unlinks what is at an ipc path before
    it binds, so they overwrote a regular file, took a live sidecar's events
    socket over, and their files stayed after a stop."""
    endpoint = f"ipc://{tmp_path}/shared.sock"
    args = ["--endpoint", endpoint] if key == "endpoint" else ["--set", f"{key}={endpoint}"]
    if key == "events_resync_endpoint":
        args += ["--set", f"events_endpoint=ipc://{tmp_path}/{{}}.pub"]
    first = Sidecar(*[a.replace("{}", "first") for a in args])
    second = Sidecar(*[a.replace("{}", "second") for a in args])  # same socket path
    try:
        first.start()
        with pytest.raises(RuntimeError, match="served by another live process"):
            second.start()
        assert stats_of(first)["pid"] == first.proc.pid
        assert first.stop() == 0
        assert not (tmp_path / "shared.sock").exists()
        assert not list(tmp_path.glob("*.pub"))
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


def test_status_stats_and_metrics(capsys):
    port = sp.free_port()
    metrics = Sidecar("--metrics-port", str(port)).start()
    args = ["--instance", metrics.instance, "--set", f"runtime_dir={metrics.runtime_dir}"]
    try:
        with connect(metrics.endpoint, make_kv(2)) as client:
            client.save(tokens(2), np.arange(2)).wait()
            client.lookup(tokens(4))
        assert cli_main(["status", *args, "--timeout", "30"]) == 0
        out = capsys.readouterr().out
        assert "hit ratio 0.500" in out and "2/" in out
        assert cli_main(["stats", "--json", *args, "--timeout", "30"]) == 0
        stats = capsys.readouterr().out
        assert '"hit_ratio": 0.5' in stats
        # the daemon froze what it had made before serving (cli._serve)
        assert json.loads(stats)["gc_frozen_objects"] > 10_000

        def exported() -> bytes:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()

        # the snapshot the metrics thread reads is refreshed every second
        wait_for(lambda: b'kvsidecar_hit_ratio{tier="cpu"} 0.5' in exported())
        assert metrics.stop() == 0
        assert cli_main(["status", *args, "--timeout", "0.3"]) == 1
    finally:
        metrics.cleanup()
