"""The remote tier in the sidecar: its worker pool, probes and health.

- **Probes** (the remote index): the remote index only knows blocks this
  sidecar wrote or found. Before a lookup or load that the double-get rule
  lets through, one pipelined round trip asks the store which of the next
  keys exist, so blocks another host saved are found; the reply to the
  engine waits for it (at most `remote_timeout_seconds`).
- **Health**: the first op or probe that cannot reach the store, or times
  out, marks the tier offline (left out of lookups, loads and saves). A
  PING is tried after `remote_retry_seconds`, then twice as long after each
  failure up to `remote_retry_max_seconds`; the first one answered brings
  the tier back.

Everything here runs on the control loop's thread except the jobs it
submits to its pools, whose results come back through `collect` (probes,
pings) and the data plane (ops).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from contract.ids import BlockKeys
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.control.planner import GlobalCacheEngine
from sidecar.tiers.io_pool import Done, IoPool
from sidecar.tiers.remote.connector import RemoteUnavailable
from sidecar.tiers.remote.ops import RemoteOps
from sidecar.tiers.remote.store import RemoteStore

log = logging.getLogger("kvsidecar")


class Probe(NamedTuple):
    probe_id: int


class _Probe(NamedTuple):
    """A probe out: what it asks, and who waits for its answer."""

    keys: BlockKeys
    start: int
    ns: int
    asked: tuple[int, bytes]
    then: list[Callable[[], None]]


class Ping(NamedTuple):
    pass


class Purge(NamedTuple):
    num: int


class Backoff:
    """When to try an unavailable store again: `first` seconds after it
    failed, doubling after each failed try up to `maximum`."""

    def __init__(self, first: float, maximum: float) -> None:
        self.first = first
        self.maximum = max(first, maximum)
        self.delay = first
        self.next_try = 0.0

    def failed(self, now: float) -> float:
        """A try failed at `now`; returns the delay until the next one."""
        delay = self.delay
        self.next_try = now + delay
        self.delay = min(self.maximum, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first


class RemoteTier:
    def __init__(
        self,
        cache: GlobalCacheEngine,
        store: RemoteStore,
        threads: int,
        shm: ShmPool,
        layout: BlockLayout,
        backoff: Backoff,
        clock: Callable[[], float] = time.monotonic,
        *,
        write_streams: int = 1,
    ) -> None:
        self.cache = cache
        self.store = store
        self.pool = IoPool("remote", threads)
        self.ops = RemoteOps(
            store, self.pool, shm, layout, self.mark_offline, write_streams=write_streams
        )
        self.control_pool = IoPool("remote-probe", 2)
        """Probes and pings: engines wait on them, so they never queue
        behind bulk transfers."""
        self.backoff = backoff
        self._clock = clock
        self._probes: dict[int, _Probe] = {}
        self._asking: dict[tuple[int, bytes], int] = {}
        """(namespace, the keys asked about) -> the probe out asking it."""
        self._next_probe = 0
        self._pinging = False
        self.online = True
        self.counters = self.ops.counters
        self._submit_ping()  # learn early whether the store is there

    # ---- probes ----------------------------------------------------------------

    def probe(self, keys: BlockKeys, start: int, then: Callable[[], None], ns: int = 0) -> None:
        """Ask the store which of keys[start:] hold a value of ours; add the run found to
        the remote index (as blocks of namespace `ns`), then call `then` (on
        the loop's thread, whatever the outcome). A probe of the same keys
        already out is joined, not sent again: the parts of a load asked
        for in parts, lookups of one prompt from several engines."""
        asked = (ns, keys[start:].tobytes())
        out = self._asking.get(asked)
        if out is not None:
            self._probes[out].then.append(then)
            return
        probe_id = self._next_probe
        self._next_probe += 1
        self._probes[probe_id] = _Probe(keys, start, ns, asked, [then])
        self._asking[asked] = probe_id
        wanted = [k.tobytes() for k in keys[start:]]
        self.control_pool.submit(Probe(probe_id), lambda: self.store.present(wanted))
        self.counters["probes"] += 1

    @property
    def pending_probes(self) -> int:
        return len(self._probes)

    def _probed(self, done: Done) -> None:
        probe = self._probes.pop(done.token.probe_id)
        del self._asking[probe.asked]
        keys, start, ns = probe.keys, probe.start, probe.ns
        if done.error is None:
            found = next((i for i, hit in enumerate(done.result) if not hit), len(done.result))
            self.counters["probed_blocks"] += len(done.result)
            self.counters["found_blocks"] += self.cache.learn_remote(keys, start + found, ns)
        else:
            self._failed(done.error)
        for then in probe.then:
            then()

    def abandon_probes(self) -> None:
        """Shutdown: answer every request waiting on a probe now."""
        probes = list(self._probes.values())
        self._probes.clear()
        self._asking.clear()
        for probe in probes:
            for then in probe.then:
                then()

    # ---- health ------------------------------------------------------------------

    def mark_offline(self, error: BaseException) -> None:
        if not self.online:
            return
        self.online = False
        self.cache.set_online("remote", False)
        self.counters["outages"] += 1
        delay = self.backoff.failed(self._clock())
        log.warning(
            "remote tier unavailable (%s): %s; retrying in %.1f s",
            self.store.connector.describe(),
            error,
            delay,
        )

    def tick(self) -> None:
        """Called by the loop every poll: try the store again when due."""
        if not self.online and not self._pinging and self._clock() >= self.backoff.next_try:
            self._submit_ping()

    def _submit_ping(self) -> None:
        self._pinging = True
        self.control_pool.submit(Ping(), self.store.connector.ping)

    def _pinged(self, done: Done) -> None:
        self._pinging = False
        if done.error is None:
            if not self.online:
                log.warning("remote tier available again (%s)", self.store.connector.describe())
            self.online = True
            self.cache.set_online("remote", True)
            self.backoff.reset()
        elif self.online:
            self.mark_offline(done.error)
        else:
            self.backoff.failed(self._clock())

    def _failed(self, error: BaseException) -> None:
        if isinstance(error, RemoteUnavailable):
            self.mark_offline(error)
        else:
            self.counters["errors"] += 1
            log.error("remote probe failed: %r", error)

    # ---- deleting values ----------------------------------------------------------

    def purge(self, keys: list[bytes]) -> None:
        """Delete these blocks' values from the store, in the background (an
        admin's `clear`: the index forgot them already)."""
        if keys:
            self.control_pool.submit(Purge(len(keys)), lambda: self.store.delete(keys))

    def _purged(self, done: Done) -> None:
        if done.error is None:
            self.counters["purged_values"] += int(done.result)
        else:
            num = done.token.num
            log.error("remote tier: deleting %d cleared values failed: %r", num, done.error)

    # ---- results and figures -------------------------------------------------------

    def collect(self) -> None:
        """Apply the results of probes and pings (call when `control_pool.fd`
        is readable; op results go to the data plane)."""
        for done in self.control_pool.collect():
            if isinstance(done.token, Probe):
                self._probed(done)
            elif isinstance(done.token, Ping):
                self._pinged(done)
            elif isinstance(done.token, Purge):
                self._purged(done)

    def figures(self) -> dict[str, Any]:
        quota = self.cache.quota
        return {
            "store": self.store.connector.describe(),
            "namespace": self.store.namespace,
            "online": self.online,
            "retry_in_seconds": 0.0
            if self.online
            else max(0.0, self.backoff.next_try - self._clock()),
            "put_quota_blocks": quota.limit if quota else None,
            "puts_in_flight_blocks": quota.in_flight if quota else 0,
            "denied_puts": quota.denied_puts if quota else 0,
            "denied_blocks": quota.denied_blocks if quota else 0,
            "ops_in_flight": self.pool.in_flight,
            "latency": {kind: h.figures() for kind, h in self.ops.latency.items()},
            **{
                name: self.counters.get(name, 0)
                for name in (
                    "probes",
                    "probed_blocks",
                    "found_blocks",
                    "outages",
                    "unavailable_errors",
                    "checksum_failures",
                    "missing_blocks",
                    "errors",
                )
            },
        }

    def close(self) -> None:
        """Wait for the pool's jobs (each bounded by the timeout), then drop
        the connections."""
        self.pool.close()
        self.control_pool.close()
        self.store.connector.close()
