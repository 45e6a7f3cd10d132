"""`kvsidecar serve` checks every tier's settings at start: a bad `ssd_dirs`,
`remote_url` or `remote_secret_file` stops it before it binds, with a message
naming the key and value and exit status 2 (they used to start, exit 0 at
the end, and leave the tier out silently at the first registration). A
store that is down is not such an error. The start-up line lists the tiers."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_proc import Sidecar, mounted_tmpfs, run_cli

from sidecar.tiers.checks import redact


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `kvsidecar serve` with `args` to its end (a failed start)."""
    s = Sidecar(*args)
    try:
        return run_cli("serve", *s.args)
    finally:
        assert not os.path.exists(s.endpoint.removeprefix("ipc://")), "bound before the check"
        s.cleanup()


def refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "serving on" not in result.stderr
    for word in words:
        assert word in result.stderr


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        yield mnt


def test_an_ssd_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    refused(serve("--set", f"ssd_dirs={f}"), "ssd_dirs", str(f), "not a directory")


def test_an_ssd_dir_that_cannot_be_created(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    refused(serve("--set", f"ssd_dirs={f}/sub"), "ssd_dirs", f"{f}/sub", "cannot be created")


def test_an_ssd_dir_on_a_read_only_mount(read_only_dir):
    refused(serve("--set", f"ssd_dirs={read_only_dir}"), "ssd_dirs", "not writable")


@pytest.mark.parametrize("path", ["/proc/kvsidecar", "/sys/kernel", "/proc"])
def test_an_ssd_dir_under_a_pseudo_filesystem(path):
    refused(serve("--set", f"ssd_dirs={path}"), "ssd_dirs", path, "not on a disk")


def test_one_dir_listed_twice(tmp_path):
    d = tmp_path / "ssd"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    for again in (str(d), f"{d}/", f"{tmp_path}/link"):
        refused(serve("--set", f"ssd_dirs={d},{again}"), "ssd_dirs", again, "again")


def test_one_bad_dir_among_good_ones(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "file"
    bad.write_text("x")
    refused(serve("--set", f"ssd_dirs={good},{bad}"), "ssd_dirs", str(bad))


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:99999", "redis://127.0.0.1:port/0", "unix://", "redis://127.0.0.1/db"],
)
def test_an_unusable_remote_url(url):
    refused(serve("--set", f"remote_url={url}"), "remote_url", url)


def test_a_password_is_not_repeated_in_the_error():
    result = serve("--set", "remote_url=redis://:hunter2@127.0.0.1:99999/0")
    refused(result, "remote_url", "redis://127.0.0.1:99999/0")
    assert "hunter2" not in result.stderr


def test_an_unusable_secret_file(tmp_path):
    url = "redis://127.0.0.1:1/0"
    missing = tmp_path / "missing"
    refused(
        serve("--set", f"remote_url={url}", "--set", f"remote_secret_file={missing}"),
        "remote_secret_file",
        str(missing),
    )
    short = tmp_path / "short"
    short.write_text("abc\n")
    refused(
        serve("--set", f"remote_url={url}", "--set", f"remote_secret_file={short}"),
        "remote_secret_file",
        "needs at least 16",
    )


def test_good_settings_start_and_the_banner_lists_every_tier(tmp_path):
    ssd = tmp_path / "not-yet" / "ssd"  # created at the first registration
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    s = Sidecar(
        "--set",
        f"ssd_dirs={ssd}",
        "--set",
        "ssd_capacity_per_dir=8MiB",
        "--set",
        "remote_url=redis://:hunter2@127.0.0.1:1/0",  # nothing listens: not an error
        "--set",
        "remote_namespace=kvtest",
        "--set",
        f"remote_secret_file={secret}",
    )
    try:
        banner = s.start().banner
        assert "CPU tier 4MiB" in banner
        assert f"SSD tier 1 x 8MiB in {ssd}" in banner
        assert "remote tier redis://127.0.0.1:1/0, namespace 'kvtest' (MAC)" in banner
        assert "hunter2" not in banner
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_redact_keeps_the_user_and_drops_the_password():
    assert redact("redis://u:p@h:1/0") == "redis://u@h:1/0"
    assert redact("rediss://:p@h") == "rediss://h"
    assert redact("unix:///run/redis.sock") == "unix:///run/redis.sock"
