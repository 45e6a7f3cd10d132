"""Who may talk to a sidecar over TCP: only loopback, unless remote endpoints
are allowed explicitly, and then only clients holding a listed CURVE key.

Every socket here is on 127.0.0.1: the refusal of other addresses is the
configuration's, checked without serving on them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sidecar_proc as sp
import zmq
from sidecar_proc import Sidecar, connect, make_kv, tokens

from contract import endpoint as ep
from contract import events as wire
from contract import protocol as p
from engine_shim import SidecarUnavailable
from engine_shim.channel import Channel
from kvsidecar import cli
from sidecar.config import ConfigError, load_client_config, load_config

REMOTE = [
    "tcp://0.0.0.0:5555",
    "tcp://*:5555",
    "tcp://10.1.2.3:5555",
    "tcp://[::]:5555",
    "tcp://[2001:db8::1]:5555",
    "tcp://eth0:5555",
    "tcp://example.com:5555",
]
LOOPBACK = [
    "tcp://127.0.0.1:5555",
    "tcp://127.0.0.2:5555",
    "tcp://localhost:5555",
    "tcp://[::1]:5555",
]


@pytest.mark.parametrize("address", REMOTE)
@pytest.mark.parametrize("key", ["endpoint", "events_endpoint"])
def test_a_tcp_endpoint_off_loopback_is_refused(address, key):
    with pytest.raises(ConfigError, match=rf"{key}.*loopback.*allow_remote_endpoints"):
        load_config(env={}, overrides={key: address})


def test_a_resync_endpoint_off_loopback_is_refused():
    with pytest.raises(ConfigError, match=r"events_resync_endpoint.*loopback"):
        load_config(
            env={},
            overrides={
                "events_endpoint": "ipc:///tmp/x.pub",
                "events_resync_endpoint": "tcp://0.0.0.0:5556",
            },
        )


@pytest.mark.parametrize("address", REMOTE)
def test_the_cli_connects_to_an_endpoint_off_loopback_it_binds_nothing(address, capsys):
    """`kvsidecar status/stats/namespaces/clear` connect, as an engine does
    (with its CURVE client keys from the environment): the bind rules (the
    server's keys, allow_remote_endpoints) are not asked of them."""
    from kvsidecar.cli import main

    assert load_client_config(env={}, overrides={"endpoint": address}).endpoint == address
    with pytest.raises(ConfigError, match="bad"):
        load_client_config(env={}, overrides={"endpoint": "tcp://127.0.0.1:bad"})
    if address == "tcp://10.1.2.3:5555":  # nobody answers there: exit 1, not a config error
        assert main(["status", "--endpoint", address, "--timeout", "0.2"]) == 1
        assert "configuration error" not in capsys.readouterr().err


@pytest.mark.parametrize("address", LOOPBACK)
def test_loopback_and_ipc_endpoints_need_nothing_more(address):
    assert load_config(env={}, overrides={"endpoint": address}).endpoint == address
    assert ep.is_loopback(address) and ep.is_loopback("ipc:///tmp/x.sock")
    assert not any(ep.is_loopback(a) for a in REMOTE)


def test_remote_endpoints_allowed_only_with_curve_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"curve_secret_key_file.*curve_authorized_keys_dir"):
        load_config(env={}, overrides={"endpoint": REMOTE[0], "allow_remote_endpoints": True})
    with pytest.raises(ConfigError, match="curve_authorized_keys_dir"):
        load_config(env={}, overrides={"curve_secret_key_file": "/k/server.key_secret"})
    config = load_config(
        env={},
        overrides={
            "endpoint": REMOTE[0],
            "allow_remote_endpoints": True,
            "curve_secret_key_file": "/k/server.key_secret",
            "curve_authorized_keys_dir": "/k/clients",
        },
    )
    assert config.endpoint == REMOTE[0]


def keygen(directory: Path, name: str) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "keygen", str(directory), "--name", name],
        cwd=sp.ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    secret = directory / f"{name}.key_secret"
    assert os.stat(secret).st_mode & 0o077 == 0
    return secret


@pytest.mark.parametrize("name", ["", "sub/x", ".hidden"])
def test_keygen_refuses_a_name_that_is_not_a_file_name_stem(tmp_path, capsys, name):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["keygen", str(tmp_path / "keys"), "--name", name])
    assert exit_.value.code == 2
    assert f"argument --name: {name!r} is not a file name stem" in capsys.readouterr().err
    assert not (tmp_path / "keys").exists()


def test_keygen_into_a_file_or_over_a_key_pair_is_one_line_and_writes_nothing(tmp_path, capsys):
    file, keys = tmp_path / "file", tmp_path / "keys"
    file.write_text("not a directory")
    assert cli.main(["keygen", str(file)]) == 1
    assert cli.main(["keygen", str(file / "sub")]) == 1
    assert cli.main(["keygen", str(keys)]) == 0
    public = (keys / "kvsidecar.key").read_bytes()
    assert cli.main(["keygen", str(keys)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"kvsidecar: {file} is not a directory: nothing written",
        f"kvsidecar: cannot write keys into {file}/sub: [Errno 20] Not a directory: '{file}/sub'",
        f"kvsidecar: {keys}/kvsidecar.key or {keys}/kvsidecar.key_secret exists already: "
        "not replaced",
    ]
    assert file.read_text() == "not a directory"
    assert (keys / "kvsidecar.key").read_bytes() == public


@pytest.fixture
def keys(tmp_path):
    """A server key pair and an authorized client key pair, as files."""
    server_secret = keygen(tmp_path / "server", "server")
    client_secret = keygen(tmp_path / "client", "engine")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "engine.key").write_bytes((tmp_path / "client" / "engine.key").read_bytes())
    return {
        "server_secret": server_secret,
        "server_public": tmp_path / "server" / "server.key",
        "client_secret": client_secret,
        "authorized": authorized,
    }


@pytest.fixture
def curve_sidecar(keys):
    port, events, resync = sp.free_port(), sp.free_port(), sp.free_port()
    s = Sidecar(
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--set",
        "allow_remote_endpoints=true",
        "--set",
        f"curve_secret_key_file={keys['server_secret']}",
        "--set",
        f"curve_authorized_keys_dir={keys['authorized']}",
        "--set",
        f"events_endpoint=tcp://127.0.0.1:{events}",
        "--set",
        f"events_resync_endpoint=tcp://127.0.0.1:{resync}",
    )
    s.resync = f"tcp://127.0.0.1:{resync}"  # type: ignore[attr-defined]
    s.events = f"tcp://127.0.0.1:{events}"  # type: ignore[attr-defined]
    try:
        yield s.start()
        assert s.stop() == 0
    finally:
        s.cleanup()


def stats(endpoint: str, curve: ep.CurveClientKeys | None, timeout: float = 2.0) -> dict:
    channel = Channel(endpoint, timeout, curve=curve)
    try:
        reply, _ = channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        return reply.stats
    finally:
        channel.close()


def test_with_curve_only_a_listed_client_key_gets_an_answer(curve_sidecar, keys, tmp_path):
    authorized = ep.load_curve_client_keys(keys["server_public"], keys["client_secret"])
    assert stats(curve_sidecar.endpoint, authorized)["pid"] == curve_sidecar.proc.pid
    public, secret = zmq.curve_keypair()
    stranger = authorized._replace(public=public, secret=secret)
    with pytest.raises(SidecarUnavailable):
        stats(curve_sidecar.endpoint, stranger, timeout=0.5)
    with pytest.raises(SidecarUnavailable):
        stats(curve_sidecar.endpoint, None, timeout=0.5)  # no CURVE at all
    wrong_server = authorized._replace(server=zmq.curve_keypair()[0])
    with pytest.raises(SidecarUnavailable):
        stats(curve_sidecar.endpoint, wrong_server, timeout=0.5)
    assert stats(curve_sidecar.endpoint, authorized)["pid"] == curve_sidecar.proc.pid


def test_an_engine_and_the_cli_find_their_keys_in_the_environment(
    curve_sidecar, keys, monkeypatch, capsys
):
    monkeypatch.setenv(ep.CURVE_SERVER_KEY_VAR, str(keys["server_public"]))
    monkeypatch.setenv(ep.CURVE_CLIENT_KEY_VAR, str(keys["client_secret"]))
    with connect(curve_sidecar.endpoint, make_kv(3)) as client:
        assert client.save(tokens(2), np.arange(2)).wait() == 2 * sp.TOKENS_PER_BLOCK
    from kvsidecar.cli import main

    assert main(["stats", "--json", "--endpoint", curve_sidecar.endpoint]) == 0
    assert f'"pid": {curve_sidecar.proc.pid}' in capsys.readouterr().out


def test_the_resync_socket_answers_only_a_listed_client_key(curve_sidecar, keys):
    ctx = zmq.Context.instance()

    def dump(curve: ep.CurveClientKeys | None) -> bytes | None:
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            ep.apply_curve(req, curve)
        req.connect(curve_sidecar.resync)
        try:
            req.send(wire.DUMP_REQUEST)
            return req.recv() if req.poll(2000 if curve else 500) else None
        finally:
            req.close(0)

    assert dump(None) is None
    authorized = ep.load_curve_client_keys(keys["server_public"], keys["client_secret"])
    assert dump(authorized) is not None


def test_a_router_follows_a_curve_sidecars_events_only_with_a_listed_key(
    curve_sidecar, keys, monkeypatch
):
    from router.router import Router
    from router.serve import RouterServer
    from router.subscriber import Source

    authorized = ep.load_curve_client_keys(keys["server_public"], keys["client_secret"])
    source = [Source(curve_sidecar.events, curve_sidecar.resync)]
    with_key = RouterServer(Router("radix"), "tcp://127.0.0.1:0", source, curve=authorized)
    without = RouterServer(Router("radix"), "tcp://127.0.0.1:0", source)
    monkeypatch.setenv(ep.CURVE_SERVER_KEY_VAR, str(keys["server_public"]))
    monkeypatch.setenv(ep.CURVE_CLIENT_KEY_VAR, str(keys["client_secret"]))
    try:
        with connect(curve_sidecar.endpoint, make_kv(3)) as client:
            assert client.save(tokens(3), np.arange(3)).wait() == 3 * sp.TOKENS_PER_BLOCK
            keys_saved = [bytes(k) for k in client.block_keys(tokens(3))]

        def held(server: RouterServer) -> int:
            server.poll_once(50)
            return max(server.router.find_matches(keys_saved).scores.values(), default=0)

        sp.wait_for(lambda: held(with_key) == 3)  # the keyed router sees the saved blocks
        # The other got no event in all that time (and its resync is refused too).
        for _ in range(20):
            assert held(without) == 0
    finally:
        with_key.close()
        without.close()


def test_a_secret_key_others_can_read_or_a_missing_key_is_refused_at_start(keys):
    os.chmod(keys["server_secret"], 0o644)
    s = Sidecar(
        "--endpoint",
        f"tcp://127.0.0.1:{sp.free_port()}",
        "--set",
        f"curve_secret_key_file={keys['server_secret']}",
        "--set",
        f"curve_authorized_keys_dir={keys['authorized']}",
    )
    try:
        with pytest.raises(RuntimeError, match=r"readable by group or others.*chmod 600"):
            s.start()
        os.chmod(keys["server_secret"], 0o600)
        s.args[s.args.index(f"curve_authorized_keys_dir={keys['authorized']}")] = (
            f"curve_authorized_keys_dir={keys['authorized']}/missing"
        )
        with pytest.raises(RuntimeError, match="curve_authorized_keys_dir"):
            s.start()
    finally:
        s.cleanup()


def test_loopback_tcp_without_curve_still_serves():
    s = Sidecar("--endpoint", f"tcp://127.0.0.1:{sp.free_port()}")
    try:
        s.start()
        assert stats(s.endpoint, None)["pid"] == s.proc.pid
        assert s.stop() == 0
    finally:
        s.cleanup()
