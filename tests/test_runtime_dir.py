"""The runtime directory a sidecar puts its socket and lock in: created
private, never taken through a symlink, never one that others may write or
that belongs to someone else, and never chmodded unless this process made it.

The refusals are the daemon's: each runs a real `kvsidecar serve`.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import sidecar_proc as sp
from sidecar_proc import Sidecar

from sidecar import runtime
from sidecar.config import ConfigError, load_config


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def serve_fails(runtime_dir: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvsidecar serve` that is expected to exit on its own (a refusal)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsidecar",
            "serve",
            "--instance",
            f"t{os.getpid()}-rt",
            "--cpu-capacity",
            "4MiB",
            "--set",
            f"runtime_dir={runtime_dir}",
            *args,
        ],
        cwd=sp.ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def sidecar_in(runtime_dir: Path) -> Sidecar:
    return Sidecar(runtime_dir=runtime_dir)


def test_a_symlinked_runtime_dir_is_refused_and_its_target_left_alone(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    os.chmod(target, 0o755)
    link = tmp_path / "link"
    link.symlink_to(target)
    out = serve_fails(link)
    assert out.returncode == 1, out.stderr
    assert str(link) in out.stderr and "symlink" in out.stderr
    assert "Traceback" not in out.stderr
    assert mode_of(target) == 0o755
    assert os.listdir(target) == []  # no socket, no lock put there
    assert link.is_symlink()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o730, 0o703], ids=oct)
def test_a_runtime_dir_others_may_write_is_refused_and_unchanged(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    out = serve_fails(shared)
    assert out.returncode == 1, out.stderr
    assert str(shared) in out.stderr and "writable" in out.stderr
    assert mode_of(shared) == mode
    assert os.listdir(shared) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
def test_a_runtime_dir_of_another_user_is_refused_and_unchanged(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o755)
    os.chown(theirs, 65534, 65534)
    out = serve_fails(theirs)
    assert out.returncode == 1, out.stderr
    assert str(theirs) in out.stderr and "uid 65534" in out.stderr
    assert mode_of(theirs) == 0o755 and os.stat(theirs).st_uid == 65534
    assert os.listdir(theirs) == []


def test_ensure_runtime_dir_refuses_without_changing_anything(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(runtime.UnsafeRuntimeDir, match="symlink"):
        runtime.ensure_runtime_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(runtime.UnsafeRuntimeDir, match="not a directory"):
        runtime.ensure_runtime_dir(tmp_path / "file")
    os.chmod(target, 0o775)
    with pytest.raises(runtime.UnsafeRuntimeDir, match="writable"):
        runtime.ensure_runtime_dir(target)
    assert mode_of(target) == 0o775


def test_a_relative_runtime_dir_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigError, match="runtime_dir"):
        load_config(env={}, overrides={"runtime_dir": "run"})
    with pytest.raises(ConfigError, match="runtime_dir"):
        load_config(env={"KVSIDECAR_RUNTIME_DIR": "./run"})
    out = serve_fails("run")
    assert out.returncode == 2 and "configuration error" in out.stderr
    assert not (sp.ROOT / "run").exists()


def test_missing_directories_are_created_private_and_existing_parents_unchanged(tmp_path):
    os.chmod(tmp_path, 0o755)
    run = tmp_path / "a" / "b" / "run"
    s = sidecar_in(run)
    try:
        s.start()
        for made in (tmp_path / "a", tmp_path / "a" / "b", run):
            assert mode_of(made) == 0o700, made
        assert mode_of(tmp_path) == 0o755
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_an_existing_private_runtime_dir_is_used_as_it_is(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o750)  # readable by the group, writable by no one else: ours to use
    s = sidecar_in(run)
    try:
        s.start()
        assert mode_of(run) == 0o750
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_failed_start_removes_the_directories_it_created_and_only_those(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        created = tmp_path / "new" / "run"
        out = serve_fails(created, "--endpoint", busy)
        assert out.returncode == 1 and "served by another live process" in out.stderr, out.stderr
        assert os.listdir(tmp_path) == []
        existing = tmp_path / "existing"
        existing.mkdir(mode=0o700)
        out = serve_fails(existing, "--endpoint", busy)
        assert out.returncode == 1, out.stderr
        assert existing.is_dir() and os.listdir(existing) == []
