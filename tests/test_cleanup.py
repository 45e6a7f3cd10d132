"""`kvsidecar cleanup`: what a sidecar killed by SIGKILL leaves (its shm
segments, socket and lock file) is removed, and only once no live process
holds the instance; a live instance is refused and keeps everything.
Real sidecars, killed for real; cleanup runs as its own process."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import sidecar_proc as sp
from sidecar_proc import DEADLINE, Sidecar

from contract.endpoint import InstancePaths
from sidecar.cleanup import instances_in


def cleanup(runtime_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    return sp.run_cli("cleanup", "--set", f"runtime_dir={runtime_dir}", *args)


def leftovers(s: Sidecar) -> tuple[list[str], list[str]]:
    """(its shm segments, the entries of its runtime directory)."""
    return s.shm_segments(), sorted(os.listdir(s.runtime_dir))


def killed(s: Sidecar) -> Sidecar:
    """`s`, started, then killed by SIGKILL: it removes nothing."""
    s.start()
    assert s.proc is not None
    s.proc.kill()
    s.proc.wait(DEADLINE)
    return s


def test_cleanup_removes_what_a_killed_sidecar_left_and_says_what(sidecar: Sidecar) -> None:
    segments, _ = leftovers(sidecar)
    assert sidecar.proc is not None
    sidecar.proc.kill()
    sidecar.proc.wait(DEADLINE)
    assert leftovers(sidecar) == (
        segments,
        [f"{sidecar.instance}.admin", f"{sidecar.instance}.lock", f"{sidecar.instance}.sock"],
    )
    done = cleanup(sidecar.runtime_dir, "--instance", sidecar.instance)
    assert done.returncode == 0, done.stderr
    for name in segments:
        assert f"removed shm segment /{name}" in done.stdout
    assert f"removed {sidecar.runtime_dir}/{sidecar.instance}.sock" in done.stdout
    assert f"removed {sidecar.runtime_dir}/{sidecar.instance}.lock" in done.stdout
    assert f"removed {sidecar.runtime_dir}/{sidecar.instance}.admin" in done.stdout
    assert "4MiB of shared memory freed" in done.stdout
    assert leftovers(sidecar) == ([], [])


def test_cleanup_of_a_live_instance_refuses_and_removes_nothing(sidecar: Sidecar) -> None:
    before = leftovers(sidecar)
    done = cleanup(sidecar.runtime_dir, "--instance", sidecar.instance)
    assert done.returncode == 1
    assert "already running" in done.stderr and "nothing removed" in done.stderr
    assert done.stdout == ""
    assert leftovers(sidecar) == before
    assert sp.stats_of(sidecar)["pid"] == sidecar.proc.pid  # type: ignore[union-attr]


def test_cleanup_of_an_instance_that_left_nothing_changes_nothing() -> None:
    runtime_dir = sp.tmp_dir()
    try:
        done = cleanup(runtime_dir, "--instance", f"t{os.getpid()}-never")
        assert done.returncode == 0, done.stderr
        assert "nothing to remove" in done.stdout
        assert os.listdir(runtime_dir) == []  # its lock taken for the proof, and removed
    finally:
        os.rmdir(runtime_dir)


def test_cleanup_all_sweeps_the_dead_instances_and_leaves_the_live_one() -> None:
    dead = killed(Sidecar())
    runtime_dir = dead.runtime_dir
    other_dead = killed(Sidecar(runtime_dir=runtime_dir))
    live = Sidecar(runtime_dir=runtime_dir).start()
    try:
        names = {dead.instance, other_dead.instance, live.instance}
        assert set(instances_in(Path(runtime_dir))) == names
        live_segments = live.shm_segments()
        done = cleanup(runtime_dir, "--all")
        assert done.returncode == 0, done.stderr
        assert f"instance {live.instance!r}" not in done.stdout
        assert f"{live.instance!r} is already running" in done.stderr
        for s in (dead, other_dead):
            assert f"instance {s.instance!r}: removed 1 shm segment(s) and 3 file(s)" in done.stdout
            assert s.shm_segments() == []
        assert leftovers(live) == (
            live_segments,
            [f"{live.instance}.admin", f"{live.instance}.lock", f"{live.instance}.sock"],
        )
        assert live.stop() == 0
        assert os.listdir(runtime_dir) == []
    finally:
        for s in (live, other_dead, dead):  # the one that made the directory last
            s.cleanup()


def test_cleanup_takes_an_instance_or_all_not_both() -> None:
    done = cleanup("/nonexistent-kvs", "--all", "--instance", "x")
    assert done.returncode == 2 and "not both" in done.stderr


@pytest.mark.parametrize("instance", ["default", None])
def test_cleanup_without_instance_cleans_the_configured_one(instance: str | None) -> None:
    """No --instance: $KVSIDECAR_INSTANCE's, else 'default'."""
    name = f"t{os.getpid()}-conf"
    s = killed(Sidecar(instance=name))
    try:
        env = {**os.environ, "KVSIDECAR_INSTANCE": name}
        if instance is not None:  # the default instance: this one is left alone
            env.pop("KVSIDECAR_INSTANCE")
        done = sp.run_cli("cleanup", "--set", f"runtime_dir={s.runtime_dir}", env=env)
        assert done.returncode == 0, done.stderr
        if instance is None:
            assert f"instance {name!r}: removed" in done.stdout and s.shm_segments() == []
        else:
            assert "instance 'default': nothing to remove" in done.stdout
            assert s.shm_segments() != []
    finally:
        s.cleanup()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_live_sidecar_on_a_custom_endpoint_without_its_lock_file_keeps_everything(
    transport: str,
) -> None:
    """A /tmp cleaner removed the lock file of a live sidecar that does not
    serve on the instance's socket: neither cleanup nor a second start of
    the instance may take it for dead (both removed its segments and admin
    token; the start then failed at its bind)."""
    runtime_dir = sp.tmp_dir()
    endpoint = (
        f"tcp://127.0.0.1:{sp.free_port()}"
        if transport == "tcp"
        else f"ipc://{runtime_dir}/custom.sock"
    )
    live = Sidecar("--endpoint", endpoint, runtime_dir=runtime_dir).start()
    try:
        before = leftovers(live)
        twin = Sidecar("--endpoint", endpoint, instance=live.instance, runtime_dir=runtime_dir)
        with sp.frozen(live):  # it would make its lock file again within a second
            os.unlink(Path(runtime_dir) / f"{live.instance}.lock")
            done = cleanup(runtime_dir, "--instance", live.instance, "--endpoint", endpoint)
            assert done.returncode == 1 and "nothing removed" in done.stderr, done.stderr
            assert "served by another live process" in done.stderr
            with pytest.raises(RuntimeError, match="served by another live process"):
                twin.start()
        segments, files = leftovers(live)
        assert segments == before[0]
        assert f"{live.instance}.admin" in files
        assert sp.stats_of(live)["pid"] == live.proc.pid  # type: ignore[union-attr]
        assert live.stop() == 0
    finally:
        live.cleanup()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_a_live_sidecar_makes_its_removed_lock_file_again() -> None:
    """Nothing else tells a start on another endpoint, or a cleanup not
    told of the live one's endpoint, that the instance is live: within a
    second the sidecar has its lock file again, and both are refused."""
    runtime_dir = sp.tmp_dir()
    endpoint = f"ipc://{runtime_dir}/custom.sock"
    live = Sidecar("--endpoint", endpoint, runtime_dir=runtime_dir).start()
    lock = Path(runtime_dir) / f"{live.instance}.lock"
    try:
        before = leftovers(live)
        lock.unlink()
        sp.wait_for(lambda: lock.exists() and lock.read_text().strip() == str(live.proc.pid))  # type: ignore[union-attr]
        done = cleanup(runtime_dir, "--instance", live.instance)  # not told of its endpoint
        assert done.returncode == 1 and "already running" in done.stderr, done.stderr
        twin = Sidecar(instance=live.instance, runtime_dir=runtime_dir)  # the default endpoint
        with pytest.raises(RuntimeError, match="already running"):
            twin.start()
        assert leftovers(live) == before
        assert live.stop() == 0
        assert not lock.exists()
    finally:
        live.cleanup()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_cleanup_removes_a_killed_sidecars_custom_ipc_sockets() -> None:
    runtime_dir = sp.tmp_dir()
    endpoint, events = f"ipc://{runtime_dir}/custom.sock", f"ipc://{runtime_dir}/events.sock"
    args = ("--endpoint", endpoint, "--set", f"events_endpoint={events}")
    s = killed(Sidecar(*args, runtime_dir=runtime_dir))
    try:
        assert {"custom.sock", "events.sock"} <= set(os.listdir(runtime_dir))
        done = cleanup(runtime_dir, "--instance", s.instance, *args)
        assert done.returncode == 0, done.stderr
        assert f"removed {runtime_dir}/custom.sock" in done.stdout
        assert f"removed {runtime_dir}/events.sock" in done.stdout
        assert s.shm_segments() == [] and os.listdir(runtime_dir) == []
    finally:
        s.cleanup()
        shutil.rmtree(runtime_dir, ignore_errors=True)


# --- what is not provably dead, or not ours, stays ------------------------------------

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def test_cleanup_leaves_a_live_sidecar_whose_lock_file_was_removed(sidecar: Sidecar) -> None:
    """A /tmp cleaner may remove the lock file under a live sidecar: the lock
    proves nothing then, but its socket still answers."""
    with sp.frozen(sidecar):  # it would make its lock file again within a second
        os.unlink(Path(sidecar.runtime_dir, f"{sidecar.instance}.lock"))
        before = leftovers(sidecar)
        done = cleanup(sidecar.runtime_dir, "--instance", sidecar.instance)
        assert done.returncode == 1, done.stdout
        assert "a live process listens on" in done.stderr and "nothing removed" in done.stderr
        every = cleanup(sidecar.runtime_dir, "--all")
        assert every.returncode == 0, every.stderr
        assert f"the socket of instance {sidecar.instance!r}" in every.stderr
        assert f"instance {sidecar.instance!r}" not in every.stdout
        assert leftovers(sidecar) == before
    assert sp.stats_of(sidecar)["pid"] == sidecar.proc.pid  # type: ignore[union-attr]


def dead_socket(path: Path) -> None:
    """A socket file nothing listens on, as a killed process leaves one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


@needs_root
def test_cleanup_keeps_another_users_socket_and_says_so() -> None:
    runtime_dir = sp.tmp_dir()
    instance = f"t{os.getpid()}-theirs"
    path = Path(runtime_dir, f"{instance}.sock")
    try:
        dead_socket(path)
        os.chown(path, NOBODY, -1, follow_symlinks=False)
        done = cleanup(runtime_dir, "--instance", instance)
        assert done.returncode == 0, done.stderr
        assert f"kept {path}: the socket of uid {NOBODY}, not ours" in done.stdout
        assert os.listdir(runtime_dir) == [path.name]
        os.chown(path, os.getuid(), -1, follow_symlinks=False)
        done = cleanup(runtime_dir, "--instance", instance)
        assert done.returncode == 0, done.stderr
        assert f"removed {path}" in done.stdout and os.listdir(runtime_dir) == []
    finally:
        shutil.rmtree(runtime_dir)


def segment_files(runtime_dir: str, instance: str, owners: list[int]) -> list[str]:
    """/dev/shm files named as the instance's segments 0, 1, ... are, one per
    owner, each of 4 KiB."""
    prefix = InstancePaths(Path(runtime_dir), instance).shm_prefix
    paths = [f"/dev/shm/{prefix}.{i}" for i in range(len(owners))]
    for path, owner in zip(paths, owners, strict=True):
        with open(path, "wb") as f:
            f.write(bytes(4096))
        os.chown(path, owner, -1)
    return paths


@needs_root
def test_cleanup_leaves_another_users_segment_under_the_instances_name() -> None:
    """Another user's file squatting a name in sticky /dev/shm: not ours to
    remove (without root, unlinking it fails); a warning names it."""
    runtime_dir = sp.tmp_dir()
    instance = f"t{os.getpid()}-squat"
    ours, theirs = segment_files(runtime_dir, instance, [os.getuid(), NOBODY])
    try:
        done = cleanup(runtime_dir, "--instance", instance)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert f"{theirs} belongs to uid {NOBODY}" in done.stderr
        assert f"removed shm segment /{os.path.basename(ours)}" in done.stdout
        assert "4KiB of shared memory freed" in done.stdout
        assert not os.path.exists(ours) and os.stat(theirs).st_uid == NOBODY
    finally:
        for path in (ours, theirs):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.rmdir(runtime_dir)


# --- after a crash under systemd: the runtime directory is gone ------------------------

UNMAKEABLE = f"/sys/kvs-t{os.getpid()}/run"
"""A runtime directory that does not exist and cannot be made (not by root
either), as systemd's RuntimeDirectory after the service stopped, for its user."""


@pytest.mark.parametrize("every", [False, True], ids=["instance", "all"])
def test_cleanup_without_the_runtime_directory_removes_the_segments_only(every: bool) -> None:
    instance = f"t{os.getpid()}-gone"
    (segment,) = segment_files(UNMAKEABLE, instance, [os.getuid()])
    try:
        done = cleanup(UNMAKEABLE, *(["--all"] if every else ["--instance", instance]))
        assert done.returncode == 0, done.stderr
        assert f"instance {instance!r}: removed 1 shm segment(s) and 0 file(s)" in done.stdout
        assert not os.path.exists(segment) and not os.path.exists(UNMAKEABLE)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no /sys/kernel")
def test_cleanup_that_cannot_take_the_lock_says_why_in_one_line() -> None:
    """A runtime directory where no lock file can be made (not ours, or
    read-only to us): one line and exit 1, not a traceback."""
    done = cleanup("/sys/kernel", "--instance", f"t{os.getpid()}-ro")
    assert done.returncode == 1
    assert done.stderr.startswith("kvsidecar: ") and done.stderr.count("\n") == 1, done.stderr
