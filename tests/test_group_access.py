"""Engines of other Unix users: with `group` set, a real sidecar gives its
runtime directory (0750), ipc socket and shm segments (0660) to that group
and keeps the lock owner-only; an engine of a member saves and loads, one
of a user outside the group cannot reach the socket or open a segment.

The users and the group are made for the module with useradd/groupadd
(root only; those tests skip elsewhere). The installed Python may live where
they cannot read (/root), so each of their processes starts as root, imports
what it needs, then drops to the user (setgroups, setgid, setuid) before it
touches the sidecar: what the kernel checks from there on is the user's.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import sidecar_proc as sp
from sidecar_proc import DEADLINE, Sidecar

from sidecar.config import ConfigError, group_id, load_config

TESTS = Path(__file__).resolve().parent


class Account(NamedTuple):
    name: str
    uid: int
    gids: list[int]
    """Primary group first, then the supplementary ones."""


class Accounts(NamedTuple):
    group: str
    gid: int
    member: Account
    stranger: Account


def admin(*command: str) -> None:
    """Run useradd & co; another process editing /etc/passwd at the same
    moment makes them fail ("cannot lock"), so try again until the deadline."""
    failures: list[str] = []

    def done() -> bool:
        result = subprocess.run(command, capture_output=True, text=True)
        failures.append(result.stderr)
        return result.returncode == 0

    try:
        sp.wait_for(done, timeout=60.0, interval=0.2)
    except AssertionError:
        raise AssertionError(f"{' '.join(command)} failed: {failures[-1]}") from None


def account(name: str) -> Account:
    primary = pwd.getpwnam(name).pw_gid
    others = [g for g in os.getgrouplist(name, primary) if g != primary]
    return Account(name, pwd.getpwnam(name).pw_uid, [primary, *others])


@pytest.fixture(scope="module")
def accounts() -> Iterator[Accounts]:
    """A throwaway group, a user in it (as a supplementary group) and one not."""
    if os.geteuid() != 0:
        pytest.skip("making a throwaway user and group needs root")
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.skip("no useradd/groupadd here")
    tag = f"kvs{os.getpid()}"
    group, member, stranger = f"{tag}g", f"{tag}m", f"{tag}x"
    made: list[tuple[str, ...]] = []
    try:
        admin("groupadd", group)
        made.append(("groupdel", group))
        for user, extra in ((member, ["-G", group]), (stranger, [])):
            admin("useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *extra, user)
            made.append(("userdel", user))
        yield Accounts(group, grp.getgrnam(group).gr_gid, account(member), account(stranger))
    finally:
        for command in reversed(made):
            admin(*command)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A new /tmp/kvs-t<pid>-* directory others may search (not list), to
    hold a sidecar's runtime directory; removed at the end."""
    base = Path(sp.tmp_dir("grp"))
    os.chmod(base, 0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def mode_gid(path: Path | str) -> tuple[int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


# ---- configuration ----------------------------------------------------------------


def test_an_unknown_group_is_a_configuration_error_naming_the_key() -> None:
    """Looked up where it is used: the configuration itself loads on any host."""
    config = load_config(env={}, overrides={"group": "no-such-group-kvs"})
    with pytest.raises(ConfigError, match=r"group: 'no-such-group-kvs' names no group"):
        group_id(config.group)
    with pytest.raises(ConfigError, match=r"\$KVSIDECAR_GROUP: group: .* not a valid name"):
        load_config(env={"KVSIDECAR_GROUP": "../etc"})
    with pytest.raises(ConfigError, match="group: gid 4294967295 is out of range"):
        group_id(load_config(env={"KVSIDECAR_GROUP": "4294967295"}).group)


def test_a_group_is_a_name_or_a_gid_in_any_source(tmp_path: Path) -> None:
    name = grp.getgrgid(os.getgid()).gr_name
    assert group_id(load_config(env={"KVSIDECAR_GROUP": name}).group) == os.getgid()
    (tmp_path / "c.yaml").write_text("group: 4242\n")  # a gid this host need not name
    assert group_id(load_config(tmp_path / "c.yaml", env={}).group) == 4242
    assert load_config(env={}).group is None


def test_serve_with_an_unknown_group_exits_2_naming_the_key() -> None:
    result = sp.run_cli("serve", "--set", "group=no-such-group-kvs")
    assert result.returncode == 2 and "group: 'no-such-group-kvs'" in result.stderr


# ---- what a sidecar with a group makes ---------------------------------------------


def test_the_runtime_dir_socket_and_segments_are_the_groups_and_the_lock_the_owners(
    shared_dir: Path,
) -> None:
    """As any user: the group is this process's own primary group."""
    gid = os.getgid()
    run = shared_dir / "run"
    events = f"ipc://{run}/events.sock"
    s = Sidecar(
        "--set", f"group={gid}", "--set", f"events_endpoint={events}", runtime_dir=run
    ).start()
    try:
        assert mode_gid(run) == (0o750, gid)
        for sock in (run / f"{s.instance}.sock", run / "events.sock"):
            assert stat.S_ISSOCK(os.lstat(sock).st_mode) and mode_gid(sock) == (0o660, gid)
        assert mode_gid(run / f"{s.instance}.lock")[0] == 0o600
        segments = s.shm_segments()
        assert segments
        for name in segments:
            assert mode_gid(f"/dev/shm/{name}") == (0o660, gid)
        # The hot index, made at the first registration: engines only read it.
        client = sp.connect(s.endpoint, sp.make_kv(1))
        hot = client._link.hot.index
        assert hot is not None
        assert mode_gid(f"/dev/shm{hot.name}") == (0o640, gid)
        client.close()
        assert sp.stats_of(s)["pid"] == s.proc.pid  # type: ignore[union-attr]
        assert s.stop() == 0
        assert s.shm_segments() == []
        assert not {f"{s.instance}.sock", f"{s.instance}.lock"} & set(os.listdir(run))
    finally:
        s.cleanup()


def test_an_existing_runtime_dir_the_group_cannot_search_is_refused(shared_dir: Path) -> None:
    run = shared_dir / "run"
    run.mkdir(mode=0o700)
    s = Sidecar("--set", f"group={os.getgid()}", runtime_dir=run)
    with pytest.raises(RuntimeError, match="cannot be searched by group"):
        s.start()
    assert os.listdir(run) == [] and mode_gid(run)[0] == 0o700  # unchanged


# ---- engines of other users ---------------------------------------------------------

AS_USER = """
import json, os, sys
from engine_shim.channel import SidecarUnavailable
import sidecar_proc as sp
import numpy as np

endpoint, uid, gids, segment = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
gids = [int(g) for g in gids.split(",")]
kv, zeros = sp.make_kv(7), sp.make_kv(None)
os.setgroups(gids[1:])
os.setgid(gids[0])
os.setuid(uid)
out = {"uid": os.getuid()}
try:
    os.close(os.open(segment, os.O_RDWR))
    out["segment"] = "opened"
except OSError as err:
    out["segment"] = type(err).__name__
try:
    saver = sp.connect(endpoint, kv, timeout=float(sys.argv[5]))
    out["hot index"] = saver._link.hot.index is not None  # mapped read-only
    out["saved"] = saver.save(sp.tokens(4), np.arange(4)).wait()
    saver.close()
    loader = sp.connect(endpoint, zeros, timeout=float(sys.argv[5]))
    out["loaded"] = loader.load(sp.tokens(4), np.arange(10, 14)).wait()
    loader.close()
    same = [z[10:14].numpy().tobytes() for z in zeros] == sp.expected_blocks(7, 4)
    out["same"] = same
except SidecarUnavailable as err:
    out["error"] = "SidecarUnavailable"
print(json.dumps(out))
"""


def engine_as(user: Account, s: Sidecar, timeout: float) -> dict[str, object]:
    """Run AS_USER as `user` against `s`; its JSON result."""
    (segment,) = s.shm_segments()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            AS_USER,
            s.endpoint,
            str(user.uid),
            ",".join(map(str, user.gids)),
            f"/dev/shm/{segment}",
            str(timeout),
        ],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": f"{sp.ROOT}:{TESTS}", "HOME": "/"},
        capture_output=True,
        text=True,
        timeout=2 * DEADLINE,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_an_engine_of_a_member_saves_and_loads_and_one_of_a_stranger_is_refused(
    accounts: Accounts, shared_dir: Path
) -> None:
    s = Sidecar("--set", f"group={accounts.group}", runtime_dir=shared_dir / "run").start()
    try:
        member = engine_as(accounts.member, s, timeout=30.0)
        assert member == {
            "uid": accounts.member.uid,
            "segment": "opened",
            "hot index": True,
            "saved": 4 * sp.TOKENS_PER_BLOCK,
            "loaded": 4 * sp.TOKENS_PER_BLOCK,
            "same": True,
        }
        # The directory keeps the stranger from the socket; the segment's
        # mode from the memory.
        stranger = engine_as(accounts.stranger, s, timeout=3.0)
        assert stranger == {
            "uid": accounts.stranger.uid,
            "segment": "PermissionError",
            "error": "SidecarUnavailable",
        }
        assert s.stop() == 0
    finally:
        s.cleanup()


SERVE_AS = """
import os, sys
from kvsidecar.cli import build_parser
import sidecar.server.server, sidecar.sd_notify, sidecar.tiers.checks, shm.segments

args = build_parser().parse_args(sys.argv[3:])
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
sys.exit(args.func(args))
"""


def test_a_sidecar_whose_user_is_not_in_the_group_refuses_to_start(
    accounts: Accounts, shared_dir: Path
) -> None:
    os.chown(shared_dir, accounts.stranger.uid, -1)  # where the stranger may make its runtime dir
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            SERVE_AS,
            str(accounts.stranger.uid),
            str(accounts.stranger.gids[0]),
            "serve",
            "--instance",
            f"t{os.getpid()}-notmember",
            "--cpu-capacity",
            "4MiB",
            "--set",
            f"runtime_dir={shared_dir / 'run'}",
            "--set",
            f"group={accounts.group}",
        ],
        cwd=sp.ROOT,
        env={**os.environ, "HOME": "/"},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert result.returncode == 2, result.stderr
    assert f"is not in group {accounts.gid}" in result.stderr
    assert os.listdir(shared_dir) == []  # refused before it made anything
