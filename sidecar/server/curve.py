"""ZeroMQ CURVE for the sidecar's tcp:// sockets: encryption, and a ZAP
handler that lets in only the clients whose public keys are listed.

With `curve_secret_key_file` set, every tcp:// socket the sidecar binds
(the engines' endpoint, the KV events and their resync) is a CURVE server;
ipc:// sockets are left to the runtime directory's permissions. A client
whose key is not listed, or that does not speak CURVE, fails its handshake
and is never answered.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from sidecar.config import Config


class CurveKeyError(OSError):
    """A CURVE key file or directory that cannot serve: missing, unreadable,
    without its key, or a secret others may read."""


class CurveFiles(NamedTuple):
    secret_key_file: Path
    """The sidecar's key pair (a .key_secret file), mode 0600."""
    authorized_keys_dir: Path
    """The public keys (*.key) of the clients let in."""

    @classmethod
    def of(cls, config: Config) -> CurveFiles | None:
        """The files `config` names (None without CURVE)."""
        if config.curve_secret_key_file is None or config.curve_authorized_keys_dir is None:
            return None
        return cls(Path(config.curve_secret_key_file), Path(config.curve_authorized_keys_dir))


class CurveGuard:
    """The sidecar's key pair and the authenticator of one ZeroMQ context.

    Built whole (the keys loaded and checked, the authenticator running) or
    not at all (CurveKeyError); `close` stops the authenticator, before the
    context is terminated."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], files: CurveFiles) -> None:
        self.public, self.secret = _server_keys(files.secret_key_file)
        clients = files.authorized_keys_dir
        if not clients.is_dir():
            raise CurveKeyError(
                f"curve_authorized_keys_dir {clients} is not a directory: put the clients' "
                "public keys (*.key files from kvsidecar keygen) in one"
            )
        if not zmq.auth.load_certificates(clients):
            raise CurveKeyError(
                f"curve_authorized_keys_dir {clients} holds no public key (*.key): "
                "no client could connect"
            )
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(clients))

    def secure(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        """Make `sock` a CURVE server if it will bind `endpoint` over tcp://."""
        if endpoint.startswith("tcp://"):
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_server = True

    def close(self) -> None:
        self._auth.stop()


def _server_keys(path: Path) -> tuple[bytes, bytes]:
    try:
        mode = os.stat(path).st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise CurveKeyError(f"curve_secret_key_file {path}: {err}") from None
    if secret is None:
        raise CurveKeyError(
            f"curve_secret_key_file {path} holds no secret key: give the .key_secret file"
        )
    if mode & 0o077:
        raise CurveKeyError(
            f"curve_secret_key_file {path} (mode {stat.S_IMODE(mode):04o}) is readable by "
            f"group or others: chmod 600 {path}"
        )
    return public, secret
