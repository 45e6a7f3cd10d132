"""`ThreadClients`: one registered `KVClient` per SGLang thread that calls
the backend, and `CallRecord`: what those calls moved, for SGLang's storage
metrics.

SGLang's cache controller calls its storage backend from several threads
at once (the prefetch query, the prefetch I/O and the backup thread), and
a KVClient is one thread's: each thread gets its own, registered with the
same host pool planes, made on its first call and closed with the backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_shim.client import KVClient


class ThreadClients:
    def __init__(self, make: Callable[[], KVClient]) -> None:
        """`make`: a new registered client (raises if it cannot be made)."""
        self._make = make
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[KVClient] = []
        self._closed = False

    def get(self) -> KVClient:
        """This thread's client; RuntimeError once closed."""
        client: KVClient | None = getattr(self._local, "client", None)
        if client is not None and not self._closed:
            return client
        if self._closed:
            raise RuntimeError("the kvsidecar storage backend is closed")
        client = self._make()
        with self._lock:
            if self._closed:
                client.close()
                raise RuntimeError("the kvsidecar storage backend is closed")
            self._all.append(client)
        self._local.client = client
        return client

    def __len__(self) -> int:
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        """Close every thread's client (SGLang stops its threads first). Idempotent."""
        with self._lock:
            self._closed = True
            clients, self._all = self._all, []
        for client in clients:
            client.close()


@dataclass
class CallRecord:
    """Pages and GB/s of each get and set since the last `drain`."""

    page_bytes: int
    get_pages: list[int] = field(default_factory=list)
    get_gbps: list[float] = field(default_factory=list)
    set_pages: list[int] = field(default_factory=list)
    set_gbps: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, pages: int, seconds: float) -> None:
        if pages <= 0:
            return
        gbps = pages * self.page_bytes / max(seconds, 1e-9) / 1e9
        with self.lock:
            (self.get_pages if kind == "get" else self.set_pages).append(pages)
            (self.get_gbps if kind == "get" else self.set_gbps).append(gbps)

    def drain(self) -> tuple[list[int], list[float], list[int], list[float]]:
        """(get pages, get GB/s, set pages, set GB/s), then forget them."""
        with self.lock:
            out = (self.get_pages, self.get_gbps, self.set_pages, self.set_gbps)
            self.get_pages, self.get_gbps, self.set_pages, self.set_gbps = [], [], [], []
        return out
