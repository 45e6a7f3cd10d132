"""The sidecar's socket: one ZeroMQ ROUTER, and the waits of the control loop.

`Transport` binds on construction and is closed by its owner. A wait hands
the other watched fds that are ready (the I/O pools' eventfds, the event
publisher's resync socket) to `collect`, then serves every request that is
ready through `serve(frames)`. Within the busy-poll window after a request it polls without
sleeping, so a busy engine's next request is served without a wake-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from contract import protocol as p
from sidecar.server.curve import CurveFiles, CurveGuard
from sidecar.server.socket_files import SocketFile

# Plain ints: zmq's IntFlag members cost ~2 us per operation in a hot loop.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

MAX_MESSAGE_BYTES = 64 << 20


class Transport:
    def __init__(
        self,
        endpoint: str,
        serve: Callable[[list[bytes]], None],
        busy_poll: float,
        curve: CurveFiles | None = None,
    ) -> None:
        """Bind `endpoint`; `serve(frames)` handles one request (identity
        first); `busy_poll`: seconds to keep polling after a request;
        `curve`: the keys that make every tcp:// socket of this context
        (`secure`) let in only the listed clients."""
        self.endpoint = endpoint
        self._serve = serve
        self._busy_poll = busy_poll
        self._socket_file = SocketFile.claim(endpoint)  # the lock covers the default path only
        """The ipc socket file this process binds (removed at close)."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._guard: CurveGuard | None = None
        try:
            if curve is not None:
                self._guard = CurveGuard(self.ctx, curve)
            self.secure(self.sock, endpoint)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.sock.bind(endpoint)
            if self._socket_file is not None:
                self._socket_file.bound()
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._spin_until = 0.0
        self._rcvtimeo = -1

    def secure(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        """Before `sock` (of `ctx`) binds `endpoint`: a CURVE server there if
        this transport has keys and `endpoint` is tcp://."""
        if self._guard is not None:
            self._guard.secure(sock, endpoint)

    def watch(self, fd: Any) -> None:
        """Wake the loop when `fd` (an fd or a zmq socket) is readable too."""
        self._poller.register(fd, zmq.POLLIN)

    def send(self, identity: bytes, header: Any, arrays: Sequence[bytes] = ()) -> None:
        p.send_frames(self.sock, [identity, p.encode(header), *arrays])

    def request_waiting(self) -> bool:
        """Whether a request is ready to be read now."""
        return bool(self.sock.getsockopt(_EVENTS) & _POLLIN)  # type: ignore[operator]

    def wait(self, timeout_ms: int, collect: Callable[[dict[Any, int]], None]) -> None:
        """Wait up to `timeout_ms` for a request or a watched fd; give the
        ready fds to `collect`, then serve the requests that are ready."""
        if len(self._poller.sockets) == 1 and not self._busy_poll:
            self._receive(timeout_ms)
        else:
            self._poll(timeout_ms, collect)

    def _receive(self, timeout_ms: int) -> None:
        """The socket is all there is to wait for: one blocking receive.
        Per request this makes about half the poll() system calls of
        `_poll` (zmq_poll plus EVENTS checks each poll the socket's mailbox)."""
        sock = self.sock
        if timeout_ms != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo = timeout_ms
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            return
        self._serve(frames)

    def _poll(self, timeout_ms: int, collect: Callable[[dict[Any, int]], None]) -> None:
        sock = self.sock
        collect(self._ready(timeout_ms))
        # Asking EVENTS costs ~1 us; a recv that raises zmq.Again costs ~4.
        # (pyzmq types getsockopt as int | bytes; EVENTS is an int.)
        if sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
            while sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
                self._serve(sock.recv_multipart(zmq.NOBLOCK))
            self._spin_until = time.perf_counter() + self._busy_poll

    def _ready(self, timeout_ms: int) -> dict[Any, int]:
        """What is ready: within the busy-poll window, polled without sleeping."""
        while time.perf_counter() < self._spin_until:
            ready = self._poller.poll(0)
            if ready:
                return dict(ready)
        return dict(self._poller.poll(timeout_ms))

    def close(self) -> None:
        """Close the socket and remove its file (idempotent)."""
        if not self.sock.closed:
            self.sock.close(0)
        if self._guard is not None:
            self._guard.close()  # its thread's socket would hold the context open
            self._guard = None
        if not self.ctx.closed:
            self.ctx.term()
        if self._socket_file is not None:
            self._socket_file.remove()
