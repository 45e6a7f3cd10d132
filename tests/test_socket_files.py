"""sidecar.server.socket_files: which files at an ipc path a sidecar may
clear before its bind, and which it removes at close."""

from __future__ import annotations

import os
import socket

import pytest

from sidecar.runtime import InstanceRunning
from sidecar.server.socket_files import SocketFile, claim_socket_file


def unix_socket(path, listen: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listen:
        sock.listen()
    return sock


def test_a_dead_socket_is_cleared_a_live_one_and_other_files_are_not(tmp_path):
    path = tmp_path / "s.sock"
    with unix_socket(path, listen=False):  # bound, not listening: refuses connections
        claim_socket_file(str(path))
    assert not path.exists()
    with (
        unix_socket(path, listen=True),
        pytest.raises(InstanceRunning, match="served by another live process"),
    ):
        claim_socket_file(str(path))
    assert path.exists()
    path.unlink()
    path.write_text("data")
    with pytest.raises(FileExistsError):
        claim_socket_file(str(path))
    assert path.read_text() == "data"


def test_a_socket_whose_connect_fails_otherwise_is_not_taken_for_dead(tmp_path):
    """Only a refused connection means its process is gone: a full backlog
    (or a socket this user may not connect to) left it live once, and it was
    removed from under the sidecar serving it."""
    path = tmp_path / "busy.sock"
    with unix_socket(path, listen=False) as server:
        server.listen(0)
        waiting = []
        try:
            for _ in range(8):  # fill the backlog: the next connect would block
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                client.setblocking(False)
                try:
                    client.connect(str(path))
                except BlockingIOError:
                    client.close()
                    break
                waiting.append(client)
            with pytest.raises(InstanceRunning, match="may be served by a live process"):
                claim_socket_file(str(path))
            assert path.exists()
        finally:
            for client in waiting:
                client.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_another_users_socket_is_never_removed(tmp_path):
    path = tmp_path / "theirs.sock"
    with unix_socket(path, listen=False):
        os.chown(path, 65534, 65534)
        with pytest.raises(PermissionError, match="not ours"):
            claim_socket_file(str(path))
    assert path.exists()


def test_close_removes_only_the_socket_this_process_bound(tmp_path):
    path = tmp_path / "s.sock"
    file = SocketFile.claim(f"ipc://{path}")
    assert file is not None
    with unix_socket(path, listen=True):
        file.bound()
    path.rename(tmp_path / "old.sock")  # another process took the path since
    with unix_socket(path, listen=True):
        file.remove()
        assert path.exists()
    assert SocketFile.claim("ipc://@abstract") is None
    assert SocketFile.claim("tcp://127.0.0.1:5555") is None


def test_a_second_claim_waits_for_the_first_bind_and_then_finds_it_live(tmp_path):
    """Two sidecars started at once on one path both found it free before
    either bound, and both said they served: the claim now holds the
    directory until its bind is done."""
    import threading

    path = tmp_path / "s.sock"
    first = SocketFile.claim(f"ipc://{path}")
    assert first is not None
    outcome: list[BaseException | None] = []

    def second() -> None:
        try:
            SocketFile.claim(f"ipc://{path}")
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not outcome  # waits on the first claim
    with unix_socket(path, listen=True):
        first.bound()
        thread.join(30)
        assert isinstance(outcome[0], InstanceRunning)
        first.remove()
