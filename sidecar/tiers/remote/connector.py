"""The remote tier's store, seen as batches of whole values by key.

A `Connector` is what kvsidecar needs from a distributed key-value store
(Redis, Valkey, or anything with the same four batch operations). kvsidecar
never runs a store of its own: it talks to one the user already runs.

Contract, for every implementation:
- each call is one batch, sent with as few round trips as the store allows
  (pipelined), and is safe to call from several threads at once;
- a call that cannot reach the store, or that gets no answer within the
  connector's timeout, raises `RemoteUnavailable`; nothing else about the
  store's health is reported by exceptions;
- a per-key failure the store reports (out of memory, a moved slot) fails
  that key only: `put` reports it in its result, `get` returns None for it;
- values are opaque bytes; framing and checksums belong to the caller;
- a value's `Later` pieces are made in order, each once every piece before
  it has been handed to the store (sent, for a store over a socket).

`get_into` has a default (a `get`, then a copy); a connector that can
receive values straight into the caller's buffers overrides it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Chunk = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Later:
    """`size` bytes of a value that are made only once every piece before
    them has been sent: `make()` gives them (called once). A value whose
    last bytes depend on its first ones (a MAC after its block) is finished
    while it is sent, each piece hashed right after the socket took it; a
    Later of size 0 is only that signal."""

    size: int
    make: Callable[[], Chunk]

    def made(self) -> Chunk:
        out = self.make()
        if memoryview(out).nbytes != self.size:
            raise ValueError(f"a Later piece of {self.size} bytes made {memoryview(out).nbytes}")
        return out


Piece = Chunk | Later
Chunks = Sequence[Piece]
"""One value as consecutive pieces (a header, then a view of an shm slot,
then its MAC), written back to back without being joined first."""


def piece_bytes(piece: Piece) -> int:
    return piece.size if isinstance(piece, Later) else memoryview(piece).nbytes


Buffers = Sequence[memoryview]
"""Writable 1-D byte views (format "B") that one value fills, in order."""


class RemoteError(Exception):
    """The remote store refused or failed an operation."""


class RemoteUnavailable(RemoteError):
    """The remote store could not be reached or did not answer in time."""


class Connector(ABC):
    """Batch get / put / delete of whole values by key, and reads of their
    first bytes (`heads`)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, None where the key is absent (or its read
        failed on the store's side)."""

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool | None]:
        """Read the value of keys[i] into buffers[i], filled in order. Per key:
        True, read; None, absent (or its read failed on the store's side);
        False, a value of another size than the buffers hold, not read.
        A key whose result is not True leaves its buffers as they were;
        when the call raises, any of them may be partly written."""
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffer lists")
        out: list[bool | None] = []
        for value, bufs in zip(self.get(keys), buffers, strict=True):
            if value is None or len(value) != sum(b.nbytes for b in bufs):
                out.append(None if value is None else False)
                continue
            pos = 0
            for b in bufs:
                b[:] = value[pos : pos + b.nbytes]
                pos += b.nbytes
            out.append(True)
        return out

    @abstractmethod
    def put(
        self, keys: Sequence[bytes], values: Sequence[Chunks], ttl: float | None = None
    ) -> list[bool]:
        """Store values[i] (its pieces concatenated, each `Later` made
        once the pieces before it are sent) under keys[i]; True where the
        store accepted it. With `ttl`, the store drops them `ttl` seconds
        (rounded up to a millisecond) after it took them."""

    @abstractmethod
    def heads(self, keys: Sequence[bytes], nbytes: int) -> list[bytes | None]:
        """The first `nbytes` of each key's value; None where the key is
        absent, holds fewer bytes or no string value."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the keys; returns how many existed."""

    @abstractmethod
    def ping(self) -> None:
        """Return if the store answers (every node of a cluster); else raise
        RemoteUnavailable."""

    @abstractmethod
    def close(self) -> None:
        """Drop every connection (idempotent)."""

    def describe(self) -> str:
        """Where the store is, for logs and stats (no credentials)."""
        return type(self).__name__
