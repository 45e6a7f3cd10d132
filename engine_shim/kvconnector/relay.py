"""`RankRelay`: hands the plans the TP leader got from the sidecar to the
other ranks of its engine, on this host.

Each follower binds a ZeroMQ PULL socket at a path named by the engine id
and its rank (in a directory of this user's, mode 0700); the leader
PUSHes to all of them. ZeroMQ queues what the leader sends before a
follower binds, so no rank waits for another to start. Every message is
tagged (scheduler step, kind, request): a follower takes the one it needs
and keeps the others until asked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import zmq

from engine_shim.transfer import LayeredTransfer, TransferHandle

log = logging.getLogger(__name__)

Tag = tuple[int, str, str]
"""(scheduler step, "load" or "save", request id)."""

T = TypeVar("T")

KEEP_STEPS = 1024
"""A follower drops messages older than this many steps behind the one it
asks for (a plan it never asked for: its step's work failed before)."""


def relay_dir() -> Path:
    """This user's directory of relay sockets, made 0700 if new; refused if
    it is a symlink or someone else's."""
    path = Path(tempfile.gettempdir()) / f"kvsidecar-relay-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{path} must be a directory of this user's with mode 0700")
    return path


def socket_path(engine_id: str, rank: int) -> Path:
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return relay_dir() / f"{digest}-{rank}.sock"


class RankRelay:
    def __init__(self, engine_id: str, tp_rank: int, tp_size: int) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._rank = tp_rank
        self._inbox: dict[Tag, Any] = {}
        self._path: Path | None = None
        self._socks: list[zmq.Socket[bytes]] = []
        self._abandoned: set[Tag] = set()
        """Follower: tags it gave up waiting for (their plans are cancelled if they come)."""
        if tp_rank == 0:
            for rank in range(1, tp_size):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"ipc://{socket_path(engine_id, rank)}")
                self._socks.append(sock)
        else:
            self._path = socket_path(engine_id, tp_rank)
            self._path.unlink(missing_ok=True)  # a crashed rank's
            sock = self._ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{self._path}")
            self._socks.append(sock)

    def send(self, tag: Tag, payload: Any) -> None:
        """Leader: hand `payload` (picklable) to every other rank."""
        frame = pickle.dumps((tag, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._socks:
            sock.send(frame, copy=False)

    def take(self, tag: Tag, timeout: float) -> Any:
        """Follower: the payload sent under `tag`; TimeoutError if it has not
        come within `timeout` seconds (the leader failed or is stuck)."""
        deadline = time.monotonic() + timeout
        sock = self._socks[0]
        while tag not in self._inbox:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"rank {self._rank}: no plan from the leader for {tag}")
            got, payload = pickle.loads(sock.recv())
            self._inbox[got] = payload
        for old in [t for t in self._inbox if t[0] < tag[0] - KEEP_STEPS]:
            del self._inbox[old]
        return self._inbox.pop(tag)

    def follow(self, tag: Tag, timeout: float, cancel: Callable[[Any], None]) -> Any:
        """Follower: `take(tag, timeout)`, after handing `cancel` the plan of
        each tag it gave up on that has come since: such a plan is never
        run, as the blocks it names may be another request's by then."""
        for late_tag, payload in self.late(self._abandoned).items():
            self._abandoned.discard(late_tag)
            plan = payload[0] if late_tag[1] == "load" and payload is not None else payload
            if plan is not None:
                log.warning("kvsidecar: cancelling the leader's late plan for %s", late_tag)
                cancel(plan)
        try:
            return self.take(tag, timeout)
        except TimeoutError:
            self._abandoned.add(tag)
            raise

    def late(self, tags: set[Tag]) -> dict[Tag, Any]:
        """Follower: the payloads of `tags` (ones it gave up waiting for)
        that have come since, taken out; never waits."""
        sock = self._socks[0]
        while sock.poll(0):
            got, payload = pickle.loads(sock.recv())
            self._inbox[got] = payload
        return {tag: self._inbox.pop(tag) for tag in tags if tag in self._inbox}

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._socks = []
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


def lead(relay: RankRelay | None, tag: Tag, ask: Callable[[], T], share: Callable[[T], Any]) -> T:
    """Leader (or a rank alone): `ask()` the sidecar, and hand the other ranks
    `share(its answer)` under `tag`, or None if it raised (then re-raised)."""
    try:
        got = ask()
    except Exception:
        if relay is not None:
            relay.send(tag, None)
        raise
    if relay is not None:
        relay.send(tag, share(got))
    return got


def plan_of(transfer: TransferHandle | LayeredTransfer) -> Any:
    """What a save's followers get: the leader's plan."""
    return transfer.plan


def plan_and_tokens(transfer: TransferHandle | LayeredTransfer) -> tuple[Any, int]:
    """What a load's followers get: the plan, and the tokens cached once it lands."""
    return transfer.plan, transfer.num_tokens
