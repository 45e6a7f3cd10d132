"""The Redis / Valkey connector: redis-py connections, hiredis replies, pipelining.

One batch is one pipeline per server: every command is written first, then
every reply is read (hiredis parses them when it is installed). SET is
packed here rather than by redis-py's packer: the RESP prefix and the
value's small header go out as one buffer and the block itself as a view of
its shm slot, so a block reaches the socket with no copy at all (redis-py's
hiredis packer copies every value, which measured ~0.45 GB/s).

Cluster mode uses `redis.cluster.RedisCluster` for the topology (which node
serves a key's slot); each batch is split by node and pipelined to each. A
reply of MOVED or ASK fails its key and makes the next batch refresh the
slot map.

Timeouts: every connect, send and reply waits at most `timeout` seconds,
and nothing is retried here (redis-py's own retries are turned off): the
caller decides what to do when the store is down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError
from redis.retry import Retry

from sidecar.connector import Chunk, Chunks, Connector, RemoteUnavailable

log = logging.getLogger("kvsidecar")

_CRLF = b"\r\n"
_SMALL = 16 << 10
"""Chunks up to this size are joined into the running buffer; larger ones
(block views) are sent as they are."""
_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(map(_bulk, args))


class RedisConnector(Connector):
    """A standalone server (`cluster=False`) or a Redis Cluster reached
    through any of its nodes (`cluster=True`), at `url`."""

    def __init__(
        self, url: str, *, timeout: float = 1.0, cluster: bool = False, max_connections: int = 64
    ) -> None:
        self.url = url
        self.cluster = cluster
        self._options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
            "max_connections": max_connections,
            "health_check_interval": 0,
        }
        self._lock = threading.Lock()
        self._pool: redis.ConnectionPool | None = None
        self._cluster: RedisCluster | None = None
        self._refresh = False
        if not cluster:
            self._pool = redis.ConnectionPool.from_url(url, **self._options)

    def describe(self) -> str:
        host = self.url.split("@")[-1]  # never log a password
        return f"redis{' cluster' if self.cluster else ''} {host}"

    # ---- the four batch operations ---------------------------------------------

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        replies = self._batch(keys, lambda i: [_command(b"GET", keys[i])])
        return [r if isinstance(r, bytes) else None for r in replies]

    def put(self, keys: Sequence[bytes], values: Sequence[Chunks]) -> list[bool]:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")

        def pack(i: int) -> list[Chunk]:
            chunks = values[i]
            size = sum(memoryview(c).nbytes for c in chunks)
            return [b"*3\r\n$3\r\nSET\r\n" + _bulk(keys[i]) + b"$%d\r\n" % size, *chunks, _CRLF]

        return [r == b"OK" for r in self._batch(keys, pack)]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [r == 1 for r in self._batch(keys, lambda i: [_command(b"EXISTS", keys[i])])]

    def delete(self, keys: Sequence[bytes]) -> int:
        replies = self._batch(keys, lambda i: [_command(b"UNLINK", keys[i])])
        return sum(r for r in replies if isinstance(r, int))

    def ping(self) -> None:
        for (reply,) in _exchange([(pool, [_command(b"PING")], 1) for pool in self._pools()]):
            if reply != b"PONG":
                raise RemoteUnavailable(f"{self.describe()}: PING answered {reply!r}")

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.disconnect()
            if self._cluster is not None:
                self._cluster.close()
                self._cluster = None

    # ---- routing -----------------------------------------------------------------

    def _batch(self, keys: Sequence[bytes], pack: Callable[[int], list[Chunk]]) -> list[object]:
        """Pipeline one command per key (chunks from `pack(index)`) to the
        server(s) holding the keys; the replies in key order (a
        ResponseError where a command failed). Raises RemoteUnavailable on
        a connection error or timeout."""
        if not keys:
            return []
        groups = self._route(keys)
        exchanges = [(pool, [c for i in idx for c in pack(i)], len(idx)) for pool, idx in groups]
        out: list[object] = [None] * len(keys)
        for (_, idx), replies in zip(groups, _exchange(exchanges), strict=True):
            for i, reply in zip(idx, replies, strict=True):
                out[i] = reply
        if any(isinstance(r, ResponseError) and _is_redirect(r) for r in out):
            self._refresh = True
        return out

    def _route(self, keys: Sequence[bytes]) -> list[tuple[redis.ConnectionPool, list[int]]]:
        if not self.cluster:
            assert self._pool is not None
            return [(self._pool, list(range(len(keys))))]
        cluster = self._topology()
        groups: dict[str, tuple[redis.ConnectionPool, list[int]]] = {}
        try:
            for i, key in enumerate(keys):
                node = cluster.get_node_from_key(key)
                if node.name not in groups:
                    conn = cluster.get_redis_connection(node)
                    groups[node.name] = (conn.connection_pool, [])
                groups[node.name][1].append(i)
        except redis.RedisError as err:  # a slot no node covers: the cluster is broken
            raise RemoteUnavailable(f"{self.describe()}: {err}") from None
        return list(groups.values())

    def _pools(self) -> list[redis.ConnectionPool]:
        if not self.cluster:
            assert self._pool is not None
            return [self._pool]
        cluster = self._topology()
        return [cluster.get_redis_connection(n).connection_pool for n in cluster.get_primaries()]

    def _topology(self) -> RedisCluster:
        """The cluster client, created (or its slot map refreshed) on demand."""
        with self._lock:
            try:
                if self._cluster is None:
                    self._cluster = RedisCluster.from_url(self.url, **self._options)
                    self._refresh = False
                elif self._refresh:
                    self._refresh = False
                    self._cluster.nodes_manager.initialize()
            except (*_DOWN, redis.RedisError) as err:
                self._cluster = None
                raise RemoteUnavailable(f"{self.describe()}: {err}") from None
            return self._cluster


def _exchange(exchanges: list[tuple[redis.ConnectionPool, list[Chunk], int]]) -> list[list]:
    """For each (pool, chunks of n commands, n): send the chunks on one
    connection of the pool, then read its n replies. Every server's commands
    are sent before any reply is read, so the servers of a cluster work at
    once. Raises RemoteUnavailable (dropping the connections) on a
    connection error or timeout."""
    held: list[tuple[redis.ConnectionPool, Any]] = []
    ok = False
    try:
        for pool, chunks, _ in exchanges:
            conn = pool.get_connection()
            held.append((pool, conn))
            conn.send_packed_command(_coalesce(chunks), check_health=False)
        replies = [_replies(conn, n) for (_, conn), (_, _, n) in zip(held, exchanges, strict=True)]
        ok = True
        return replies
    except _DOWN as err:
        raise RemoteUnavailable(str(err)) from None
    finally:
        for pool, conn in held:
            if not ok:
                conn.disconnect()  # replies may be left unread: never reuse it
            pool.release(conn)


def _replies(conn: Any, n: int) -> list[object]:
    """The next n replies on `conn`; a failed command's is its ResponseError."""
    replies: list[object] = []
    for _ in range(n):
        try:
            replies.append(conn.read_response(disable_decoding=True))
        except ResponseError as err:  # this command failed; the next replies follow
            replies.append(err)
    return replies


def _coalesce(chunks: list[Chunk]) -> list[Chunk]:
    """Join runs of small chunks, so that a pipeline of n commands costs a
    few sends per block, not one per piece."""
    out: list[Chunk] = []
    small: list[Chunk] = []
    for chunk in chunks:
        if memoryview(chunk).nbytes <= _SMALL:
            small.append(chunk)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(chunk)
    if small:
        out.append(b"".join(small))
    return out


def _is_redirect(err: ResponseError) -> bool:
    return str(err).startswith(("MOVED", "ASK"))
