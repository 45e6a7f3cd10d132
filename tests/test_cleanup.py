"""`kvsidecar cleanup`: what a sidecar killed by SIGKILL leaves (its shm
segments, socket and lock file) is removed, and only once no live process
holds the instance; a live instance is refused and keeps everything.
Real sidecars, killed for real; cleanup runs as its own process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import sidecar_proc as sp
from sidecar_proc import DEADLINE, Sidecar

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
