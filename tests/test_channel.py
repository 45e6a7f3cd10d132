"""engine_shim.channel against a bare ROUTER socket: request ids and bounded waits."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from contract import protocol as p
from engine_shim.channel import Channel, SidecarUnavailable

V = p.PROTOCOL_VERSION


def test_each_wait_keeps_its_own_timeout_when_the_socket_reuses_the_last(tmp_path):
    """The receive timeout is set on the socket only when it changes: a short
    wait after long ones still ends on time, and a long one after it still
    gets its late reply."""
    endpoint = f"ipc://{tmp_path}/router"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    delays = iter([0.0, 0.0, None, 0.0, 0.5, None])  # None: never answer
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            identity, header = router.recv_multipart()
            delay = next(delays)
            if delay is not None:
                time.sleep(delay)
                rid = msgspec.msgpack.decode(header)["id"]
                router.send_multipart(
                    [identity, p.encode({"v": V, "id": rid, "ok": True, "stats": {}})]
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    channel = Channel(endpoint, timeout=5.0)
    try:
        assert channel.call(p.Stats(v=V, id=0))[0].ok
        assert channel.call(p.Stats(v=V, id=0))[0].ok  # the same timeout, not set again
        start = time.monotonic()
        with pytest.raises(SidecarUnavailable, match=r"within 0\.2 s"):
            channel.call(p.Stats(v=V, id=0), timeout=0.2)
        assert time.monotonic() - start < 1.0
        assert channel.call(p.Stats(v=V, id=0))[0].ok
        assert channel.call(p.Stats(v=V, id=0), timeout=2.0)[0].ok  # answered in 0.5 s
        start = time.monotonic()
        with pytest.raises(SidecarUnavailable, match=r"within 0\.2 s"):
            channel.call(p.Stats(v=V, id=0), timeout=0.2)
        assert time.monotonic() - start < 1.0
    finally:
        stop.set()
        thread.join(5)
        channel.close()
        router.close(0)


def test_a_send_refused_after_the_socket_turned_writable_is_sidecar_unavailable(
    tmp_path, monkeypatch
):
    """A first send waits for the socket to become writable, then sends again.
    That second send can still find no peer (a connection made and dropped
    at once, as to an address off loopback in CI): the caller gets
    SidecarUnavailable, as for any other send, not zmq.Again."""
    endpoint = f"ipc://{tmp_path}/router"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    channel = Channel(endpoint, timeout=5.0)
    sent: list[int] = []

    def no_peer(sock: zmq.Socket, frames: list[bytes], flags: int = 0) -> None:
        sent.append(len(frames))
        raise zmq.Again()

    try:
        monkeypatch.setattr(p, "send_frames", no_peer)
        with pytest.raises(SidecarUnavailable, match="no sidecar connected"):
            channel.send(p.Stats(v=V, id=0))
        assert len(sent) == 2  # tried, waited until writable (connected), tried again
    finally:
        channel.close()
        router.close(0)
