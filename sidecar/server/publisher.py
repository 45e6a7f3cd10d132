"""KV event publishing: the CPU tier's index events, out to cluster routers.

A ZMQ PUB socket carries `contract.events.EventBatch`es (one per control-loop
iteration that produced events) numbered 1, 2, ... under a random epoch,
and, after HEARTBEAT_SECONDS with nothing to send, a heartbeat: a batch with
no events carrying the seq of the last batch (routers forget a sidecar that
has gone silent, and see a restarted idle one by its new epoch). A
ZMQ ROUTER socket answers resync requests with a full dump of the index as of
the last batch sent, so a subscriber that missed batches (late join, high
water mark, restart) catches up. Both sockets are driven by the sidecar's
control loop: no thread, no lock, and a dump is always consistent with the
sequence number it carries.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence

import zmq

from contract import events as wire
from sidecar.control.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from sidecar.control.index import RadixIndex
from sidecar.control.node import RadixNode
from sidecar.server.socket_files import SocketFile

log = logging.getLogger("kvsidecar")

SEND_HWM = 100_000
"""Batches queued per subscriber before PUB drops (the subscriber then resyncs)."""
HEARTBEAT_SECONDS = 1.0


class EventPublisher:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        resync_endpoint: str | None,
        worker_id: int,
        secure: Callable[[zmq.Socket[bytes], str], None],
    ) -> None:
        """`secure(sock, endpoint)` readies each socket before it binds (CURVE)."""
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.worker_id = worker_id
        self._last_sent = 0.0
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.resync: zmq.Socket[bytes] | None = None
        self._files: list[SocketFile] = []
        """The ipc socket files bound here (removed at close)."""
        try:
            self._bind(self.pub, endpoint, secure)
            if resync_endpoint is not None:
                self.resync = ctx.socket(zmq.ROUTER)
                self.resync.setsockopt(zmq.LINGER, 0)
                self.resync.setsockopt(zmq.MAXMSGSIZE, 4096)
                self._bind(self.resync, resync_endpoint, secure)
        except BaseException:
            self.close()
            raise

    def _bind(
        self,
        sock: zmq.Socket[bytes],
        endpoint: str,
        secure: Callable[[zmq.Socket[bytes], str], None],
    ) -> None:
        """Bind, never over a file that is not a dead socket of ours (libzmq
        would unlink it: a regular file, a live sidecar's events socket)."""
        file = SocketFile.claim(endpoint)
        try:
            secure(sock, endpoint)
            sock.bind(endpoint)
        except BaseException:
            if file is not None:
                file.release()
            raise
        if file is not None:
            file.bound()
            self._files.append(file)

    def publish(self, events: list[KVEvent]) -> None:
        """Send the events as the next batch; with none, a heartbeat if
        HEARTBEAT_SECONDS passed since the last message."""
        now = time.monotonic()
        if events:
            self.seq += 1
        elif now - self._last_sent < HEARTBEAT_SECONDS:
            return
        batch = wire.EventBatch(self.epoch, self.seq, self.worker_id, 0, _to_msgs(events))
        self.pub.send_multipart([wire.TOPIC, wire.encode(batch)], copy=False)
        self._last_sent = now

    def serve_resync(self, indexes: Sequence[RadixIndex], most: int = 16) -> None:
        """Answer the waiting resync requests, at most `most` (call after
        `publish`). One dump, made once, answers them all: a crowd of
        routers resyncing at once must not hold the control loop for a
        dump each."""
        sock = self.resync
        if sock is None:
            return
        dump: bytes | None = None
        for _ in range(most):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                break
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) < 2 or frames[-1] != wire.DUMP_REQUEST:
                reply = wire.encode(
                    wire.ErrorReply(
                        f"expected a single frame {wire.DUMP_REQUEST!r} from a REQ socket"
                    )
                )
            else:
                if dump is None:
                    runs = [run for index in indexes for run in index_runs(index)]
                    dump = wire.encode(
                        wire.DumpReply(self.epoch, self.seq, self.worker_id, 0, runs)
                    )
                reply = dump
            sock.send_multipart([*frames[:-1], reply])

    def close(self) -> None:
        for sock in (self.pub, self.resync):
            if sock is not None:
                sock.close(0)
        for file in self._files:
            file.remove()
        self._files = []


def _to_msgs(events: list[KVEvent]) -> list[wire.StoredMsg | wire.RemovedMsg | wire.ClearedMsg]:
    out: list[wire.StoredMsg | wire.RemovedMsg | wire.ClearedMsg] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(wire.StoredMsg(e.keys.tobytes(), None if e.parent is None else e.parent))
        elif isinstance(e, BlockRemoved):
            out.append(wire.RemovedMsg(e.keys.tobytes()))
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append(wire.ClearedMsg())
    return out


def index_runs(index: RadixIndex) -> list[wire.StoredMsg]:
    """Every ready run of `index`, parents first (unready nodes are leaves)."""
    runs: list[wire.StoredMsg] = []
    stack: list[tuple[RadixNode, bytes | None]] = [
        (child, None) for child in index.root.children.values()
    ]
    while stack:
        node, parent = stack.pop()
        if not node.ready:
            continue
        runs.append(wire.StoredMsg(node.key_bytes, parent))
        stack.extend((child, bytes(node.last_key)) for child in node.children.values())
    return runs
