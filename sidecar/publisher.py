"""KV event publishing: the CPU tier's index events, out to cluster routers.

A ZMQ PUB socket carries `router.wire.EventBatch`es (one per control-loop
iteration that produced events) numbered 1, 2, ... under a random epoch. A
ZMQ ROUTER socket answers resync requests with a full dump of the index as of
the last batch sent, so a subscriber that missed batches (late join, high
water mark, restart) catches up. Both sockets are driven by the sidecar's
control loop: no thread, no lock, and a dump is always consistent with the
sequence number it carries.
"""

from __future__ import annotations

import logging
import uuid

import zmq

from router import wire
from sidecar.control.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from sidecar.control.index import RadixIndex
from sidecar.control.node import RadixNode

log = logging.getLogger("kvsidecar")

SEND_HWM = 100_000
"""Batches queued per subscriber before PUB drops (the subscriber then resyncs)."""


class EventPublisher:
    def __init__(
        self, ctx: zmq.Context, endpoint: str, resync_endpoint: str | None, worker_id: int
    ) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.worker_id = worker_id
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.resync: zmq.Socket | None = None
        try:
            self.pub.bind(endpoint)
            if resync_endpoint is not None:
                self.resync = ctx.socket(zmq.ROUTER)
                self.resync.setsockopt(zmq.LINGER, 0)
                self.resync.setsockopt(zmq.MAXMSGSIZE, 4096)
                self.resync.bind(resync_endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        batch = wire.EventBatch(self.epoch, self.seq, self.worker_id, 0, _to_msgs(events))
        self.pub.send_multipart([wire.TOPIC, wire.encode(batch)], copy=False)

    def serve_resync(self, index: RadixIndex | None) -> None:
        """Answer every waiting resync request (call after `publish`)."""
        sock = self.resync
        if sock is None:
            return
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) < 2 or frames[-1] != wire.DUMP_REQUEST:
                reply: wire.DumpReply | wire.ErrorReply = wire.ErrorReply(
                    f"expected a single frame {wire.DUMP_REQUEST!r} from a REQ socket"
                )
            else:
                runs = [] if index is None else index_runs(index)
                reply = wire.DumpReply(self.epoch, self.seq, self.worker_id, 0, runs)
            sock.send_multipart([*frames[:-1], wire.encode(reply)])

    def close(self) -> None:
        for sock in (self.pub, self.resync):
            if sock is not None:
                sock.close(0)


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
