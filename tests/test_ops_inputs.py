"""What an operator types or leaves on the host, refused or coped with in one
clear line instead of a traceback: a `--timeout` no wait can have, and a file
of another user squatting a sidecar's shm name at `serve`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import sidecar_proc as sp

from contract.endpoint import InstancePaths
from kvsidecar.cli import main

TIMEOUT_COMMANDS = [["status"], ["stats"], ["namespaces"], ["clear", "--all"]]
NOBODY = 65534


@pytest.mark.parametrize("command", TIMEOUT_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "1e300", "two"])
def test_a_timeout_out_of_range_is_a_usage_error(
    command: list[str], timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--timeout", timeout, "--set", "runtime_dir=/nonexistent-kvs"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --timeout: {timeout!r} is not a number of seconds in (0, 3600]" in err
    assert "Traceback" not in err


def test_a_timeout_may_be_at_most_an_hour() -> None:
    """The bound of every client timeout (engine_shim.channel.MAX_TIMEOUT);
    checked on the type alone: a command would wait that long for an answer."""
    from kvsidecar.cli import timeout_seconds

    assert timeout_seconds("3600") == 3600.0 and timeout_seconds("1e-3") == 0.001
    with pytest.raises(argparse.ArgumentTypeError, match=r"in \(0, 3600\]"):
        timeout_seconds("3600.5")


@pytest.mark.parametrize("command", TIMEOUT_COMMANDS, ids=lambda c: c[0])
def test_a_timeout_in_range_is_waited(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """No sidecar there: the command runs and says so (exit 1), not a usage error."""
    runtime_dir = sp.tmp_dir()
    try:
        assert main([*command, "--timeout", "0.2", "--set", f"runtime_dir={runtime_dir}"]) == 1
    finally:
        os.rmdir(runtime_dir)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_serve_leaves_another_users_segment_under_its_name_and_says_so_in_a_line() -> None:
    """A file of another user in sticky /dev/shm under the name a sidecar's
    first segment will have: the sidecar neither removes it (it is not ours;
    without root, unlinking it fails) nor dies with a traceback."""
    runtime_dir = sp.tmp_dir()
    instance = f"t{os.getpid()}-squat"
    squatter = f"/dev/shm/{InstancePaths(Path(runtime_dir), instance).shm_prefix}.0"
    with open(squatter, "wb"):
        pass
    os.chown(squatter, NOBODY, -1)
    try:
        done = sp.run_cli(
            "serve",
            "--instance",
            instance,
            "--set",
            f"runtime_dir={runtime_dir}",
            "--cpu-capacity",
            "4MiB",
        )
        assert os.stat(squatter).st_uid == NOBODY  # left in place
    finally:
        os.unlink(squatter)
        os.rmdir(runtime_dir)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{squatter} belongs to uid {NOBODY}" in done.stderr
    assert "cannot start: shm segment" in done.stderr
