"""The sidecar daemon: one control loop that owns every piece of cache state.

One thread, one ZeroMQ ROUTER socket. Each request is decoded, validated and
answered before the next is read, so the index, mempool and plans need no
locks. Bad input of any kind becomes an error reply (`ProtocolError`) raised
before any state changes; the loop never dies on a message.

Start-up: take the instance lock (proving no live sidecar owns the name),
remove a dead predecessor's socket and shm segments, create and pre-fault
the CPU tier, bind. Shutdown (SIGTERM/SIGINT, or under `--parent-pid` the
parent's exit, noticed within a second): refuse new loads and saves,
let in-flight plans finish for up to `drain_seconds`, cancel the rest,
then unlink the shm segments, the socket and the lock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import psutil
import zmq

from contract import protocol as p
from contract.protocol import ErrorCode, ProtocolError
from shm.layout import BlockLayout
from shm.pool import ShmPool, remove_stale_segments
from sidecar.config import Config
from sidecar.control.hits import HitStats
from sidecar.control.planner import GlobalCacheEngine
from sidecar.metrics.figures import server_stats
from sidecar.runtime import InstanceLock, InstanceRunning, endpoint_of, instance_paths
from sidecar.server.handlers import Handlers
from sidecar.server.publisher import EventPublisher
from sidecar.server.sessions import Engines
from sidecar.tiers.dataplane import DataPlane
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.remote.tier import RemoteTier
from sidecar.tiers.ssd.store import SsdStore

log = logging.getLogger("kvsidecar")

# Plain ints: zmq's IntFlag members cost ~2 us per operation in a hot loop.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

MAX_MESSAGE_BYTES = 64 << 20
POLL_MS = 100
LAPSE_LEASES = 0.25
"""A round of the control loop that takes this many leases beyond its wait
for requests renews every engine's lease: heartbeats sent meanwhile may sit
unread in the socket, so the engines' silence proves nothing."""


def default_cpu_capacity() -> int:
    """10% of RAM, at most 16 GiB, at least 64 MiB."""
    total = psutil.virtual_memory().total
    return max(64 << 20, min(total // 10, 16 << 30))


class Server(Handlers):
    def __init__(self, config: Config, *, parent_pid: int | None = None) -> None:
        """`parent_pid`: stop, as on SIGTERM, once this process's parent is no
        longer that process (it exited and the sidecar was re-parented)."""
        self.config = config
        self.parent_pid = parent_pid
        self.paths = instance_paths(config)
        self.endpoint = endpoint_of(config)
        self.boot_id = uuid.uuid4().hex
        self.started = time.time()
        self.capacity = config.cpu_capacity or default_cpu_capacity()
        self.lock: InstanceLock | None = None
        self._socket_file: str | None = None
        """The ipc socket file this process bound (removed at close)."""
        self.pool: ShmPool | None = None
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.layout: BlockLayout | None = None
        self.cache: GlobalCacheEngine | None = None
        self.ssd: SsdStore | None = None
        self.io: IoPool | None = None
        self.dataplane: DataPlane | None = None
        self.remote: RemoteTier | None = None
        self._deferred: dict[int, tuple[bytes, p.Load, list[bytes], int]] = {}
        """Staging plan id -> the load waiting for it (identity, request, arrays, attempt)."""
        self._identity = b""
        self._waiting_for_io: list[tuple[bytes, p.Load, list[bytes], int]] = []
        self._parked_at = 0
        self.engines = Engines(self._cancel_plan, self._hold_cpu_slots, self._release_cpu_slots)
        self.hits = HitStats(config.hit_window)
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.stopping = False
        self.snapshot: dict[str, Any] = {}
        """Stats published for the metrics thread; replaced whole, never mutated."""
        self._metrics: Any = None
        self.publisher: EventPublisher | None = None
        self._next_lease_check = 0.0
        self._max_wait_ms = max(1, min(POLL_MS, int(config.lease_seconds * 1000 / 8)))
        """The longest wait for a request. With the busy-poll window (also at
        most an eighth of a lease), a round that lapses unnoticed leaves the
        socket unread for at most half a lease: with heartbeats every third of
        a lease, a healthy engine's lease never runs out on a stall."""
        self._loop_mark = 0.0
        """The clock reading of the last round, taken before its periodic work
        (monotonic seconds; 0: none yet), so that work counts in the next
        round's lapse."""
        self.num_lapses = 0
        self._busy_poll = min(config.busy_poll_us / 1e6, config.lease_seconds / 8)
        self._spin_until = 0.0
        self._rcvtimeo = -1
        self._poller = zmq.Poller()
        self._handlers: dict[type, Callable[[Any, list[bytes]], p.Reply]] = {
            p.Register: self._register,
            p.Lookup: self._lookup,
            p.Exists: self._exists,
            p.Delete: self._delete,
            p.Load: self._load,
            p.Save: self._save,
            p.Complete: self._complete,
            p.Fail: self._fail,
            p.Cancel: self._cancel,
            p.Heartbeat: self._heartbeat,
            p.Unregister: self._unregister,
            p.Stats: self._stats,
        }

    # ---- life cycle ----------------------------------------------------------------

    def start(self) -> None:
        """Lock the instance, clean a dead predecessor's leftovers, create the
        CPU tier and bind. On failure, undo what was done and re-raise."""
        try:
            self.lock = InstanceLock(self.paths)
            socket_file = self.endpoint.removeprefix("ipc://")
            if self.endpoint.startswith("ipc://") and not socket_file.startswith("@"):
                _claim_socket_file(socket_file)  # the lock covers the default path only
                self._socket_file = socket_file
            stale = remove_stale_segments(self.paths.shm_prefix, self.config.shm_dir)
            if stale:
                log.warning("removed %d shm segment(s) left by a dead sidecar", len(stale))
            self.pool = ShmPool.create(
                self.paths.shm_prefix,
                self.capacity,
                directory=self.config.shm_dir,
                prefault=self.config.prefault,
            )
            if self.config.shm_dir and self.pool.page_kind == "4k":
                log.warning(
                    "shm_dir %s gave 4 KiB pages: mount it as hugetlbfs or tmpfs huge=always",
                    self.config.shm_dir,
                )
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.sock.bind(self.endpoint)
            self._poller.register(self.sock, zmq.POLLIN)
            if self.config.events_endpoint is not None:
                self.publisher = EventPublisher(
                    self.ctx,
                    self.config.events_endpoint,
                    self.config.events_resync_endpoint,
                    self.config.events_worker_id,
                )
                if self.publisher.resync is not None:
                    self._poller.register(self.publisher.resync, zmq.POLLIN)
            self.snapshot = self.stats()
            if self.config.metrics_port is not None:
                from sidecar.metrics.prometheus import serve_metrics

                self._metrics = serve_metrics(self.config.metrics_port, lambda: self.snapshot)
        except BaseException:
            self.close()
            raise

    def handle_signals(self) -> None:
        """Make SIGTERM and SIGINT stop the loop gracefully. Call before
        `start`, so a signal during start-up is not fatal either."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def serve_forever(self) -> None:
        """Serve until `stopping` is set (by a signal), then drain and close."""
        try:
            while not self.stopping:
                self.poll_once()
            self._drain()
        finally:
            self.close()

    def poll_once(self, timeout_ms: int = POLL_MS) -> None:
        """Serve what is ready, waiting for it up to `timeout_ms` (at most an
        eighth of a lease), then the periodic work (events, leases, the stats
        snapshot)."""
        timeout_ms = min(timeout_ms, self._max_wait_ms)
        if len(self._poller.sockets) == 1 and not self._busy_poll:
            self._receive(timeout_ms)
        else:
            self._poll(timeout_ms)
        self.retry_parked()
        if self.publisher is not None:
            index = self.cache.cpu.index if self.cache is not None else None
            self.publisher.publish([] if index is None else index.drain_events())
            self.publisher.serve_resync(index)
        now = time.monotonic()
        lapse = now - self._loop_mark - timeout_ms / 1000 - self._busy_poll
        if self._loop_mark and lapse > LAPSE_LEASES * self.config.lease_seconds:
            # The socket went unread for a while (the sidecar was stopped,
            # swapped out, or busy): a lease from now.
            self.num_lapses += 1
            log.warning("the control loop lapsed for %.2f s: engines' leases renewed", lapse)
            self.engines.renew_all(now)
        if now >= self._next_lease_check:
            if (
                self.parent_pid is not None
                and os.getppid() != self.parent_pid
                and not self.stopping
            ):
                log.warning("parent process %d exited: draining", self.parent_pid)
                self.stopping = True
            self.engines.expire(self.config.lease_seconds, now)
            self.snapshot = self.stats()
            self._next_lease_check = now + min(1.0, self.config.lease_seconds / 4)
        self._loop_mark = now  # this round's periodic work counts in the next round's lapse

    def _receive(self, timeout_ms: int) -> None:
        """The socket is all there is to wait for: one blocking receive.
        Per request this makes about half the poll() system calls of
        `_poll` (zmq_poll plus EVENTS checks each poll the socket's mailbox)."""
        sock = self.sock
        assert sock is not None
        if timeout_ms != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo = timeout_ms
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            return
        self._serve_one(frames)

    def _poll(self, timeout_ms: int) -> None:
        """Wait on the socket and the I/O pools' eventfds together."""
        sock = self.sock
        assert sock is not None
        ready = self._wait(timeout_ms)
        if self.dataplane is not None:
            for io in self.dataplane.pools:
                if io.fd in ready:
                    self.dataplane.collect(io)
        if self.remote is not None:
            if self.remote.control_pool.fd in ready:
                self.remote.collect()
            self.remote.tick()
        # Asking EVENTS costs ~1 us; a recv that raises zmq.Again costs ~4.
        if sock.getsockopt(_EVENTS) & _POLLIN:
            while sock.getsockopt(_EVENTS) & _POLLIN:
                self._serve_one(sock.recv_multipart(zmq.NOBLOCK))
            self._spin_until = time.perf_counter() + self._busy_poll

    def _wait(self, timeout_ms: int) -> dict[Any, int]:
        """What is ready: within the busy-poll window, polled without sleeping
        (the next request of a busy engine is served without a wake-up)."""
        while time.perf_counter() < self._spin_until:
            ready = self._poller.poll(0)
            if ready:
                return dict(ready)
        return dict(self._poller.poll(timeout_ms))

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        self.stopping = True

    def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_seconds

        def busy() -> bool:
            probes = self.remote.pending_probes if self.remote else 0
            return bool(self.engines.plans or (self.dataplane and self.dataplane.plans) or probes)

        while busy() and time.monotonic() < deadline:
            self.poll_once(20)
        if self.remote is not None:
            self.remote.abandon_probes()
        for plan_id in list(self.engines.plans):
            self.engines.end(plan_id, cancel=True)
        self.engines.release_orphans()
        if self.dataplane is not None:
            self.dataplane.abandon()
        for identity, req, _, _ in [*self._deferred.values(), *self._waiting_for_io]:
            self._send(identity, p.error(req.id, ErrorCode.SHUTTING_DOWN, "shutting down"))
        self._deferred.clear()
        self._waiting_for_io.clear()

    def close(self) -> None:
        """Release everything this process owns: socket, shm, lock (idempotent)."""
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self._socket_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._socket_file)
            self._socket_file = None
        if self.io is not None:  # threads may still read or write shm slots
            self.io.close()
            self.io = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.ssd is not None:
            tier = self.cache.lower.get("ssd") if self.cache is not None else None
            if tier is not None:  # the I/O threads are done: no write is in flight
                try:
                    stale = self.ssd.drop_stale(tier.mempool.free_slots())
                    log.info("SSD tier: cleared the records of %d evicted blocks", stale)
                except OSError as err:  # they may come back after the restart: no harm
                    log.warning("SSD tier: could not clear evicted blocks' records: %s", err)
            self.ssd.close()
            self.ssd = None
        if self.pool is not None:
            self.pool.close()
            self.pool.unlink()
            self.pool = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---- dispatch ------------------------------------------------------------------

    def _serve_one(self, frames: list[bytes]) -> None:
        assert self.sock is not None
        identity, body = frames[0], frames[1:]
        self._identity = identity
        try:
            request, arrays = p.decode_request(body)
            op = type(request).__name__.lower()
            self.requests[op] += 1
            reply = self._handlers[type(request)](request, arrays)
            self._adopt_background()
        except ProtocolError as err:
            self.errors[err.code.value] += 1
            reply = p.error(p.request_id(body), err.code, err.message)
        except Exception as err:  # a bug must not take the sidecar down
            log.exception("internal error serving a request")
            self.errors[ErrorCode.INTERNAL.value] += 1
            reply = p.error(p.request_id(body), ErrorCode.INTERNAL, f"internal error: {err!r}")
        if reply is not None:  # None: answered later (a load waiting for SSD reads)
            self._send(identity, reply)

    def _send(self, identity: bytes, reply: p.Reply) -> None:
        assert self.sock is not None
        p.send_frames(self.sock, [identity, p.encode(reply.header), *reply.arrays])

    # ---- figures ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return server_stats(self)


def _claim_socket_file(path: str) -> None:
    """Make `path` free for our ipc socket: a socket left by a dead process
    is removed; one a live process accepts connections on raises
    InstanceRunning; anything else that is not a socket is never touched
    (FileExistsError)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(
            errno.EEXIST, "exists and is not a socket; pick another --endpoint", path
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # left by a dead process
            return
    raise InstanceRunning(
        f"ipc://{path} is served by another live process; stop it or pick another --endpoint"
    )
