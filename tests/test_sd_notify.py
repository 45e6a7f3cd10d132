"""systemd's Type=notify: a sidecar whose NOTIFY_SOCKET names a datagram
socket sends READY=1 once it serves (a client can connect and is answered)
and STOPPING=1 when it drains. The socket is a real one bound by the test,
the sidecar a real `kvsidecar serve`."""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_proc import Sidecar

from contract import protocol as p
from engine_shim.channel import Channel
from sidecar.sd_notify import SdNotifier


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound to an abstract name, and its NOTIFY_SOCKET form."""
    name = f"kvsidecar-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield sock, "@" + name


def fields_of(sock: socket.socket, timeout: float = 30.0) -> dict[str, str]:
    sock.settimeout(timeout)
    datagram = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in datagram.split("\n"))


def test_notify_a_path(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        notifier = SdNotifier.from_environ({"NOTIFY_SOCKET": path})
        assert notifier is not None
        assert notifier.notify("READY=1", "STATUS=serving")
        assert fields_of(sock, 5) == {"READY": "1", "STATUS": "serving"}


def test_notify_an_abstract_name(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    assert SdNotifier(address).notify("STOPPING=1")
    assert fields_of(sock, 5) == {"STOPPING": "1"}


def test_no_notify_socket_no_notifier(caplog: pytest.LogCaptureFixture) -> None:
    assert SdNotifier.from_environ({}) is None
    assert SdNotifier.from_environ({"NOTIFY_SOCKET": ""}) is None
    with caplog.at_level(logging.WARNING):
        assert SdNotifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"}) is None
    assert "vsock:2:1234" in caplog.text


def test_a_socket_nobody_listens_on_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert not SdNotifier(str(tmp_path / "nobody")).notify("READY=1")
    assert "cannot notify systemd" in caplog.text


def test_serve_notifies_ready_then_stopping(
    abstract_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, address = abstract_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    sidecar = Sidecar()
    try:
        sidecar.start()
        ready = fields_of(sock)
        assert ready["READY"] == "1"
        assert sidecar.endpoint in ready["STATUS"]
        channel = Channel(sidecar.endpoint, 5.0)  # it serves once READY=1 is sent
        try:
            reply, _ = channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
            assert reply.stats["instance"] == sidecar.instance  # type: ignore[attr-defined]
        finally:
            channel.close()
        assert sidecar.proc is not None
        sidecar.terminate()
        stopping = fields_of(sock)
        assert stopping["STOPPING"] == "1"
        _, err = sidecar.proc.communicate(timeout=30)
        assert sidecar.proc.returncode == 0, err
    finally:
        sidecar.cleanup()
