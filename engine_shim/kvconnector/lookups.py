"""`Lookups`: how many leading blocks the sidecar holds, per request.

With `background=True` a lookup runs on one thread of its own, the only user
of the client's socket after registration, and `poll` answers None ("ask
again") until it is back; the scheduler loop never waits on the sidecar. A
lookup not back within the client's timeout of being asked is a miss: lookups
queued behind one stalled on a hung sidecar do not each wait a timeout in
turn. A result is kept until `forget`, so a request that could not be
scheduled this step is not looked up again.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from contract.ids import BlockKeys
from engine_shim.client import KVClient

log = logging.getLogger(__name__)


class _InFlight(NamedTuple):
    future: Future[int]
    deadline: float
    """time.monotonic() past which the lookup counts as a miss."""


class Lookups:
    def __init__(self, client: KVClient, *, background: bool) -> None:
        self._client = client
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="kvsidecar-lookup") if background else None
        )
        self._results: dict[str, _InFlight | int] = {}

    def poll(self, req_id: str, keys: BlockKeys) -> int | None:
        """Cached tokens of the prefix `keys` (0 when the sidecar is down or
        has not answered within its timeout); None while a background lookup
        is in flight. The first call for `req_id` fixes the keys until
        `forget(req_id)`."""
        result = self._results.get(req_id)
        if result is None:
            if self._pool is None:
                result = self._lookup(keys)
            else:
                future = self._pool.submit(self._lookup, keys)
                result = _InFlight(future, time.monotonic() + self._client.timeout)
            self._results[req_id] = result
        if isinstance(result, _InFlight):
            if result.future.done():
                result = result.future.result()
            elif time.monotonic() < result.deadline:
                return None
            else:
                result.future.cancel()  # still queued: never sent
                result = 0
            self._results[req_id] = result
        return result

    def _lookup(self, keys: BlockKeys) -> int:
        """`lookup_keys`, which answers a miss for a sidecar that is down or
        refuses; anything else it raises (mapping a restarted sidecar's shm,
        say) is logged and a miss too, not an error in vLLM's scheduler."""
        try:
            return self._client.lookup_keys(keys)
        except Exception:
            log.exception("kvsidecar: a lookup failed; counted as a miss")
            return 0

    def forget(self, req_id: str) -> None:
        """Drop the result (or the lookup in flight, whose answer is ignored)."""
        result = self._results.pop(req_id, None)
        if isinstance(result, _InFlight):
            result.future.cancel()

    def close(self) -> None:
        """Wait for the lookup in flight, if any; later polls are refused."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._results.clear()
