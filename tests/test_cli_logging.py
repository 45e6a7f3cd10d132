"""`kvsidecar serve --log-level/--log-format` (kvsidecar/logs.py): every line
of a real sidecar's output is on stderr in one format; the start-up and stop
lines come whatever the level."""

from __future__ import annotations

import json

import pytest
import sidecar_proc as sp
from sidecar_proc import Sidecar

from kvsidecar.cli import main

NO_SECRET = ("--set", "remote_url=redis://127.0.0.1:1/0")
"""A remote tier without a secret: a WARNING at start (nothing needs to answer there)."""


def test_json_output_is_one_object_per_line_and_the_banner_is_one_of_them() -> None:
    s = Sidecar("--log-format", "json", "--log-level", "info", *NO_SECRET)
    try:
        s.start()
        assert s.proc is not None and s.proc.stderr is not None
        s.terminate()
        assert s.proc.wait(30) == 0
        out = "".join([*s.early, s.banner, s.proc.stderr.read()])
    finally:
        s.cleanup()
    records = [json.loads(line) for line in out.splitlines()]  # every line parses
    for r in records:
        assert {"ts", "level", "logger", "message"} <= set(r), r
        assert r["ts"].endswith("+00:00")
    banner = json.loads(s.banner)
    assert banner["level"] == "INFO" and "serving on" in banner["message"]
    assert banner["instance"] == s.instance and banner["endpoint"] == s.endpoint
    assert banner["pid"] == s.proc.pid
    assert banner["tiers"][0].startswith("CPU tier 4MiB")
    assert banner["tiers"][1].startswith("remote tier redis://127.0.0.1:1/0")
    assert any(r["level"] == "WARNING" and "remote_secret_file" in r["message"] for r in records)
    assert any(r["message"] == "signal 15: draining" for r in records)  # an INFO record
    assert records[-1]["message"] == "stopped"


def test_the_level_drops_records_below_it_but_never_the_start_and_stop_lines() -> None:
    s = Sidecar("--log-level", "error", *NO_SECRET)
    try:
        s.start()
        assert s.proc is not None and s.proc.stderr is not None
        s.terminate()
        assert s.proc.wait(30) == 0
        lines = [*s.early, s.banner, *s.proc.stderr.read().splitlines(keepends=True)]
    finally:
        s.cleanup()
    assert " INFO kvsidecar: instance " in s.banner and "serving on" in s.banner
    assert not [line for line in lines if "WARNING" in line or "draining" in line]
    assert lines[-1].rstrip().endswith(" INFO kvsidecar: stopped")


def test_a_failed_start_is_a_record_in_the_format_asked_for() -> None:
    s = Sidecar("--log-format", "json", "--set", "eviction_policy=nope")
    try:
        done = sp.run_cli("serve", *s.args)
    finally:
        s.cleanup()
    assert done.returncode == 2 and done.stdout == ""
    (record,) = [json.loads(line) for line in done.stderr.splitlines()]
    assert record["level"] == "ERROR" and "configuration error: " in record["message"]
    assert "eviction_policy" in record["message"]


def test_version_comes_from_the_package_metadata(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvsidecar {version('kvsidecar')}"
