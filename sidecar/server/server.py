"""The sidecar daemon: one control loop that owns every piece of cache state.

One thread, one ZeroMQ ROUTER socket. Each request is decoded, validated and
answered before the next is read, so the index, mempool and plans need no
locks. Bad input of any kind becomes an error reply (`ProtocolError`) raised
before any state changes; the loop never dies on a message.

Start-up: take the instance lock (proving no live sidecar owns the name),
remove a dead predecessor's socket and shm segments, create and pre-fault
the CPU tier, bind. Shutdown (SIGTERM, SIGINT or SIGHUP, or under `--parent-pid` the
parent's exit, noticed within a second): refuse new loads and saves,
let in-flight plans finish for up to `drain_seconds`, cancel the rest,
then unlink the shm segments, the socket and the lock.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import psutil

from shm import hotindex
from shm.pool import ShmPool, remove_stale_segments
from shm.segments import SEGMENT_MODE
from sidecar.config import Config, format_size, group_id
from sidecar.memory_limit import cgroup_memory_limit
from sidecar.metrics.figures import server_figures
from sidecar.runtime import (
    SHARED_FILE_MODE,
    AdminToken,
    InstanceLock,
    check_group_member,
    endpoint_of,
    ensure_runtime_dir,
    instance_paths,
    raise_open_files_limit,
    refuse_if_endpoint_served,
    refuse_if_served,
    remove_created,
    share_socket_file,
)
from sidecar.sd_notify import SdNotifier
from sidecar.server.curve import CurveFiles
from sidecar.server.handlers import Handlers
from sidecar.server.pacer import Pacer
from sidecar.server.publisher import EventPublisher
from sidecar.server.transport import Transport
from sidecar.tiers.checks import check_tiers

log = logging.getLogger("kvsidecar")
start_log = logging.getLogger("kvsidecar.start")
"""Start-up progress (INFO): `kvsidecar serve` shows it without -v."""

POLL_MS = 100
LAPSE_LEASES = 0.25
"""A round of the control loop that takes this many leases beyond its wait
for requests renews every engine's lease: heartbeats sent meanwhile may sit
unread in the socket, so the engines' silence proves nothing."""


def default_cpu_capacity(root: str = "/") -> int:
    """10% of the memory this process may use (RAM, or its cgroup's memory
    limit if lower: `sidecar.memory_limit`, reading the cgroup files under
    `root`), at most 16 GiB, at least 64 MiB."""
    total: int = psutil.virtual_memory().total
    limit = cgroup_memory_limit(root)
    if limit is not None:
        total = min(total, limit)
    return max(64 << 20, min(total // 10, 16 << 30))


EXTENT_ROUND = 2 << 20
"""A default extent is a multiple of this (a 2 MiB huge page)."""


def extent_size(config: Config, capacity: int) -> int:
    """The unit in which geometries share the CPU tier (its shm segments):
    `cpu_extent_size`, or capacity/16 between 4 MiB and 256 MiB, in whole
    2 MiB, at most the capacity (rounded up to 4 KiB)."""
    if config.cpu_extent_size is not None:
        return config.cpu_extent_size
    size = min(256 << 20, max(4 << 20, capacity // 16))
    size -= size % EXTENT_ROUND
    return min(size, -(-capacity // 4096) * 4096)


PREFAULT_LOG_SECONDS = 1.0
"""Prefaulting the CPU tier logs its progress at most this often."""


class PrefaultLog:
    """A `ShmPool.create` progress callback that logs bytes done of the total
    at most every `every_seconds` (a start that takes less logs nothing: the
    banner says how long prefaulting took)."""

    def __init__(self, every_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_seconds = every_seconds
        self._clock = clock
        self._last = clock()

    def __call__(self, done: int, total: int) -> None:
        now = self._clock()
        if now - self._last < self.every_seconds:
            return
        self._last = now
        start_log.info(
            "prefaulting the CPU tier: %.2f of %.2f GiB (%d%%)",
            done / 2**30,
            total / 2**30,
            100 * done // total,
        )


class Server:
    """The daemon, composed of parts built whole by `start`: the instance lock,
    the CPU tier's shm pool, the socket (`Transport`), the request handlers
    (which own the engines' sessions and, from the first registration on,
    the tiered cache), and optionally the event publisher and the metrics
    endpoint. Before `start` and after `close` it holds none of them."""

    def __init__(
        self,
        config: Config,
        *,
        parent_pid: int | None = None,
        notifier: SdNotifier | None = None,
    ) -> None:
        """`parent_pid`: stop, as on SIGTERM, once this process's parent is no
        longer that process (it exited and the sidecar was re-parented).
        `notifier`: tell systemd READY=1 when `serve_forever` begins (the
        socket is bound by then) and STOPPING=1 when it drains."""
        self.config = config
        self.parent_pid = parent_pid
        self.notifier = notifier
        self.paths = instance_paths(config)
        self.endpoint = endpoint_of(config)
        self.boot_id = uuid.uuid4().hex
        self.started = time.time()
        self.capacity = config.cpu_capacity or default_cpu_capacity()
        self.gid = group_id(config.group)  # ConfigError for a group the host does not know
        """The group whose members' engines may connect (None: the owner's only)."""
        self.stopping = False
        self._parts: _Parts | None = None
        self.snapshot: dict[str, Any] = {}
        """Stats published for the metrics thread; replaced whole, never mutated."""
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
        self._pacer = Pacer()
        self._observe_wait_ms = POLL_MS
        """The longest wait before `auto`'s queued chains get their next slice."""
        self.num_lapses = 0
        self._busy_poll = min(config.busy_poll_us / 1e6, config.lease_seconds / 8)

    @property
    def parts(self) -> _Parts:
        """The running sidecar's parts (between `start` and `close`)."""
        if self._parts is None:
            raise RuntimeError("the sidecar is not started")
        return self._parts

    @property
    def handlers(self) -> Handlers:
        return self.parts.handlers

    @property
    def ready(self) -> bool:
        """Started (the CPU tier prefaulted, the socket bound) and not draining:
        what the metrics port's `/readyz` reports."""
        return self._parts is not None and not self.stopping

    # ---- life cycle ----------------------------------------------------------------

    def start(self) -> None:
        """Check the lower tiers' settings and the runtime directory (creating
        it), lock the instance, clean a dead predecessor's leftovers, create
        the CPU tier and bind. Raises ConfigError, before anything is done,
        for a lower tier's setting that cannot work (those tiers are built at
        the first registration) or a `group` this process is not in. On
        failure, undo what was done (the directories it created included,
        when empty) and re-raise."""
        check_tiers(self.config)
        if self.gid is not None:
            check_group_member(self.gid)
        log.debug("open files limit: %d", raise_open_files_limit())
        created = ensure_runtime_dir(self.paths.runtime_dir, self.gid)
        try:
            self._start_parts()
        except BaseException:
            remove_created(created)
            raise

    def _start_parts(self) -> None:
        with contextlib.ExitStack() as undo:  # on an error: undone in reverse
            lock = InstanceLock(self.paths)  # what makes the rest ours to create
            undo.callback(lock.release)
            # ... unless a live sidecar lost its lock file: before removing what
            # a dead one left, nothing may listen on the instance's socket or
            # on our endpoint (a tcp:// one included).
            refuse_if_served(
                self.paths.socket_path,
                f"it is instance {self.paths.instance!r}'s socket, though its lock was free "
                "(was the lock file removed?): stop that process first",
            )
            if self.endpoint != self.paths.default_endpoint:  # else just tried
                refuse_if_endpoint_served(
                    self.endpoint,
                    "stop it, or pick another endpoint if it is no sidecar of "
                    f"{self.paths.instance!r}",
                )
            token = AdminToken(self.paths.admin_token_path)
            undo.callback(token.remove)
            stale = remove_stale_segments(self.paths.shm_prefix, self.config.shm_dir)
            stale += hotindex.remove_stale(self.paths.shm_prefix)
            if stale:
                log.warning("removed %d shm segment(s) left by a dead sidecar", len(stale))
            pool = ShmPool.create(
                self.paths.shm_prefix,
                self.capacity,
                directory=self.config.shm_dir,
                segment_bytes=extent_size(self.config, self.capacity),
                prefault=self.config.prefault,
                progress=PrefaultLog(PREFAULT_LOG_SECONDS),
                mode=SEGMENT_MODE if self.gid is None else SHARED_FILE_MODE,
                gid=self.gid,
            )
            undo.callback(_remove_pool, pool)
            if self.config.shm_dir and pool.page_kind == "4k":
                log.warning(
                    "shm_dir %s gave 4 KiB pages: mount it as hugetlbfs or tmpfs huge=always",
                    self.config.shm_dir,
                )
            curve = CurveFiles.of(self.config)
            transport = Transport(self.endpoint, self._serve, self._busy_poll, curve)
            undo.callback(transport.close)
            handlers = Handlers(
                self.config,
                self.boot_id,
                pool,
                transport.send,
                transport.watch,
                self.stats,
                token.value,
            )
            undo.callback(handlers.close)  # the tiers: their I/O threads use shm slots
            publisher = None
            if self.config.events_endpoint is not None:
                publisher = EventPublisher(
                    transport.ctx,
                    self.config.events_endpoint,
                    self.config.events_resync_endpoint,
                    self.config.events_worker_id,
                    transport.secure,
                )
                undo.callback(publisher.close)
                if publisher.resync is not None:
                    transport.watch(publisher.resync)
            if self.gid is not None:  # each ipc:// socket: a router may be a member too
                bound = (
                    self.endpoint,
                    self.config.events_endpoint,
                    self.config.events_resync_endpoint,
                )
                for endpoint in filter(None, bound):
                    share_socket_file(endpoint, self.gid)
            self._parts = _Parts(pool, transport, handlers, publisher, undo.pop_all(), lock)
        self.snapshot = self.stats()
        if self.config.metrics_port is not None:
            from sidecar.metrics.http_server import serve_metrics

            host, port = self.config.metrics_host, self.config.metrics_port
            try:
                metrics = serve_metrics(host, port, lambda: self.snapshot, lambda: self.ready)
            except OSError as err:  # a name that does not resolve, not this host's, a port in use
                self.close()
                raise OSError(f"metrics_host={host} metrics_port={port}: {err}") from err
            except BaseException:
                self.close()
                raise
            self._parts.resources.callback(metrics.server_close)
            self._parts.resources.callback(metrics.shutdown)

    def handle_signals(self) -> None:
        """Make SIGTERM, SIGINT and SIGHUP stop the loop gracefully. Call
        before `start`, so a signal during start-up is not fatal either.
        SIGHUP reloads nothing: most keys size or name what start built (the
        tiers, the sockets, the shm), so a reload would be a restart anyway;
        a clean stop at least never leaves shm behind, as its default action
        (death) did."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def serve_forever(self) -> None:
        """Serve until `stopping` is set (by a signal), then drain and close."""
        try:
            if self.notifier is not None:
                self.notifier.notify(
                    "READY=1",
                    f"STATUS=serving on {self.endpoint}, CPU tier {format_size(self.capacity)}",
                )
            while not self.stopping:
                self.poll_once()
            if self.notifier is not None:
                self.notifier.notify("STOPPING=1", "STATUS=draining")
            self._drain()
        finally:
            self.close()

    def poll_once(self, timeout_ms: int = POLL_MS) -> None:
        """Serve what is ready, waiting for it up to `timeout_ms` (at most an
        eighth of a lease), then the periodic work (events, leases, the stats
        snapshot)."""
        parts = self.parts
        handlers = parts.handlers
        timeout_ms = min(timeout_ms, self._max_wait_ms, self._observe_wait_ms)
        parts.transport.wait(timeout_ms, self._collect)
        handlers.geometries.hot.stamp()  # engines trust the hot indexes while this is fresh
        handlers.retry_parked()
        if parts.publisher is not None:
            indexes = [realm.cache.cpu.index for realm in handlers.geometries]
            parts.publisher.publish([e for index in indexes for e in index.drain_events()])
            parts.publisher.serve_resync(indexes)
        now = time.monotonic()
        lapse = now - self._loop_mark - timeout_ms / 1000 - self._busy_poll
        if self._loop_mark and lapse > LAPSE_LEASES * self.config.lease_seconds:
            # The socket went unread for a while (the sidecar was stopped,
            # swapped out, or busy): a lease from now.
            self.num_lapses += 1
            log.warning("the control loop lapsed for %.2f s: engines' leases renewed", lapse)
            handlers.engines.renew_all(now)
        if now >= self._next_lease_check:
            if (
                self.parent_pid is not None
                and os.getppid() != self.parent_pid
                and not self.stopping
            ):
                log.warning("parent process %d exited: draining", self.parent_pid)
                self._stop()
            handlers.engines.expire(self.config.lease_seconds, now)
            parts.lock.keep()
            handlers.expire()  # blocks past their namespace's TTL (none set: nothing)
            self.snapshot = self.stats()
            self._next_lease_check = now + min(1.0, self.config.lease_seconds / 4)
        # Requests an `auto` policy learns from, between requests, paced.
        realms = list(handlers.geometries)
        waiting = parts.transport.request_waiting

        def observe(end: float) -> bool:  # whether any is left
            left = False
            for realm in realms:
                if waiting():  # the next realm's step too would keep it waiting
                    return True
                left = realm.cache.cpu.observe_pending(end, waiting) or left
            return left

        # Requests first: the work waits a round, and stops for one that
        # arrives meanwhile.
        wait = 0.0 if waiting() else self._pacer.run(observe)
        self._observe_wait_ms = POLL_MS if wait is None else math.ceil(wait * 1000)
        self._loop_mark = now  # this round's periodic work counts in the next round's lapse

    def _serve(self, frames: list[bytes]) -> None:
        self.parts.handlers.serve(frames)

    def _collect(self, ready: dict[Any, int]) -> None:
        for realm in self.parts.handlers.geometries:
            realm.collect(ready)

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        self._stop()

    def _stop(self) -> None:
        """Refuse new loads and saves from now on; the loop drains and ends."""
        self.stopping = True
        if self._parts is not None:
            self._parts.handlers.stopping = True

    def _drain(self) -> None:
        handlers = self.parts.handlers
        engines, realms = handlers.engines, list(handlers.geometries)
        deadline = time.monotonic() + self.config.drain_seconds

        def busy() -> bool:
            return bool(engines.plans) or any(realm.busy() for realm in realms)

        while busy() and time.monotonic() < deadline:
            self.poll_once(20)
        for realm in realms:
            realm.abandon()
        for plan_id in list(engines.plans):
            engines.end(plan_id, cancel=True)
        engines.release_orphans()
        handlers.refuse_waiting()

    def close(self) -> None:
        """Release everything this process owns: socket, shm, lock (idempotent)."""
        parts, self._parts = self._parts, None
        if parts is not None:
            parts.resources.close()

    # ---- figures ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Every figure `kvsidecar stats` prints and the metrics endpoint exports."""
        parts = self.parts
        return server_figures(
            instance=self.config.instance,
            endpoint=self.endpoint,
            boot_id=self.boot_id,
            started=self.started,
            capacity=self.capacity,
            pool=parts.pool,
            handlers=parts.handlers,
            num_lapses=self.num_lapses,
        )


class _Parts(NamedTuple):
    """What a started sidecar owns; `resources` releases it all, in the
    reverse of the order it was made."""

    pool: ShmPool
    transport: Transport
    handlers: Handlers
    publisher: EventPublisher | None
    """None unless `events_endpoint` is set."""
    resources: contextlib.ExitStack
    lock: InstanceLock


def _remove_pool(pool: ShmPool) -> None:
    pool.close()
    pool.unlink()
