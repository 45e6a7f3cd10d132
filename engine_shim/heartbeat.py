"""The heartbeat: a thread that renews a client session's lease."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from contract import protocol as p
from contract.endpoint import CurveClientKeys
from contract.protocol import ErrorCode
from engine_shim.channel import Channel, SidecarError, SidecarUnavailable


class Heartbeat:
    """Renews the lease of `session` every third of `lease()` seconds from a
    thread with its own socket (sockets are not thread-safe); a missed beat
    is harmless, the next one re-registers. Each beat answered tells `heard`
    the boot id of the sidecar that answered."""

    def __init__(
        self,
        endpoint: str,
        timeout: float,
        session: str,
        *,
        lease: Callable[[], float],
        register_request: Callable[[], p.Register],
        heard: Callable[[str], None],
        curve: CurveClientKeys | None = None,
        touch: Callable[[], tuple[Any, list[bytes]] | None] = lambda: None,
        release: Callable[[], tuple[Any, list[bytes]] | None] = lambda: None,
        rejoined: Callable[[], None] = lambda: None,
    ) -> None:
        """`touch()`: a batch of what the client did through the hot index
        (engine_shim/hotpath.py), sent with each beat, unawaited; so is
        `release()`, the slots granted to an idle client, given back.
        `rejoined()`: a beat found the session forgotten and registered it
        again (what the sidecar held for the old one, grants included, is gone)."""
        self._endpoint = endpoint
        self._timeout = timeout
        self._curve = curve
        self._request = p.Heartbeat(v=p.PROTOCOL_VERSION, id=0, session=session)
        self._lease = lease
        self._register_request = register_request
        self._heard = heard
        self._touch = touch
        self._release = release
        self._rejoined = rejoined
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvsidecar-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        channel = Channel(self._endpoint, self._timeout, curve=self._curve)
        try:
            while not self._stop.wait(max(0.01, self._lease() / 3)):
                with contextlib.suppress(SidecarUnavailable, SidecarError):
                    self._beat(channel)  # a missed beat is harmless
        finally:
            channel.close()

    def _beat(self, channel: Channel) -> None:
        """Renew the lease. A sidecar that forgot the session (it restarted)
        learns it again here, so that a TP rank making no calls of its own
        completes its engine's group; the new sidecar's shm is mapped by the
        client's own thread, when a call or a plan first needs it (`heard`)."""
        for message in (self._touch(), self._release()):
            if message is not None:
                channel.send(*message, reply=False)
        try:
            reply, _ = channel.call(self._request)
        except SidecarError as err:
            if err.code is not ErrorCode.NOT_REGISTERED:
                raise
            reply, _ = channel.call(self._register_request())
            self._rejoined()
        self._heard(reply.boot_id)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
