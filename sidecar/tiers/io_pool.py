"""A pool of I/O threads whose results go back to the single-threaded loop.

Jobs run on threads (positional file I/O releases the GIL); each result is
queued and an eventfd is bumped, which the control loop polls next to its
ZeroMQ socket. The loop wakes exactly when there is something to collect:
no busy polling, and no cache state is ever touched off the loop's thread.
"""

from __future__ import annotations

import contextlib
import os
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple


class Done(NamedTuple):
    token: Any
    result: Any
    error: BaseException | None


class IoPool:
    def __init__(self, name: str, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"kvsidecar-{name}")
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        """Readable when results wait: register it with the loop's poller."""
        self.in_flight = 0

    def submit(self, token: Any, job: Callable[[], Any]) -> None:
        """Run `job` on a thread; its result (or exception) comes back from
        `collect` with `token`."""
        self.in_flight += 1
        self._executor.submit(self._run, token, job)

    def _run(self, token: Any, job: Callable[[], Any]) -> None:
        try:
            done = Done(token, job(), None)
        except BaseException as err:  # reported to the loop, which decides
            done = Done(token, None, err)
        self._done.put(done)
        os.eventfd_write(self.fd, 1)

    def collect(self) -> list[Done]:
        """Every result that has arrived (call when `fd` is readable)."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        """Wait for running jobs, then release the threads and the eventfd.
        Jobs not started yet are dropped: a stop after `drain_seconds` must
        not wait for a queue of them (256 remote writes to a stalled store
        took 32 s, one timeout each)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        os.close(self.fd)
