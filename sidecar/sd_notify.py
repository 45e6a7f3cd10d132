"""systemd's readiness protocol (sd_notify(3)) on a plain datagram socket.

Under a unit of `Type=notify`, systemd sets NOTIFY_SOCKET to the AF_UNIX
datagram socket it listens on: a path, or an abstract name written with a
leading `@`. Each notification is one datagram of newline-separated
`KEY=VALUE` fields: `READY=1` once the service serves (systemd holds back
units ordered after it until then), `STOPPING=1` when it begins to stop,
`STATUS=...` a line `systemctl status` shows. No libsystemd: the protocol
is those few bytes.

A notification that cannot be sent is logged, never raised: systemd not
listening must not stop a sidecar that serves.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("kvsidecar")

NOTIFY_SOCKET_VAR = "NOTIFY_SOCKET"


class SdNotifier:
    """Sends notifications to one socket address (`/path` or `@abstract`)."""

    def __init__(self, address: str) -> None:
        if address.startswith("@"):
            self._target = "\0" + address[1:]  # Linux's abstract namespace
        elif address.startswith("/"):
            self._target = address
        else:
            raise ValueError(
                f"${NOTIFY_SOCKET_VAR}={address!r}: only an absolute path or an @abstract "
                "name is supported"
            )
        self.address = address

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SdNotifier | None:
        """The notifier $NOTIFY_SOCKET names; None if it is unset, empty or of
        a kind not supported (vsock: logged)."""
        env = os.environ if environ is None else environ
        address = env.get(NOTIFY_SOCKET_VAR, "")
        if not address:
            return None
        try:
            return cls(address)
        except ValueError as err:
            log.warning("%s: no systemd notifications", err)
            return None

    def notify(self, *fields: str) -> bool:
        """Send `fields` (`READY=1`, `STATUS=...`) as one datagram; False
        (logged) if it could not be sent."""
        message = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self._target)
        except OSError as err:
            log.warning("cannot notify systemd at %s: %s", self.address, err)
            return False
        return True
