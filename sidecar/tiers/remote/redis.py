"""The Redis / Valkey connector: redis-py connections, hiredis replies, pipelining.

One batch is one pipeline per server: every command is written first (a
sendmsg gathers up to IOV_MAX buffers), then every reply is read (hiredis
parses them when it is installed). SET is
packed here rather than by redis-py's packer: the RESP prefix and the
value's small header go out as one buffer and the block itself as a view of
its shm slot, so a block reaches the socket with no copy at all (redis-py's
hiredis packer copies every value, which measured ~0.45 GB/s).

GET into buffers (`get_into`, the tier's reads) skips hiredis: the replies
are parsed here off the connection's socket, and each value is received
straight into its shm slot, one copy from the kernel instead of three
(socket -> hiredis's buffer -> a bytes object -> the slot).

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
import math
import os
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis._parsers import BaseParser
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AskError, RedisClusterException, ResponseError
from redis.retry import Retry

from sidecar.tiers.remote.connector import (
    Buffers,
    Chunk,
    Chunks,
    Connector,
    Later,
    Piece,
    RemoteUnavailable,
    piece_bytes,
)

log = logging.getLogger("kvsidecar")

_CRLF = b"\r\n"
_SMALL = 16 << 10
"""Chunks up to this size are joined into the running buffer; larger ones
(block views) are sent as they are."""
_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)
_SCRATCH = 64 << 10
"""Bytes received at a time for reply headers (and whatever follows them)."""
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
"""Buffers one sendmsg takes at most (1,024 on Linux; sysconf's -1, "no
limit", would be taken as 16)."""
_MAX_LINE = 1 << 10
"""A reply header (`$<size>`, or an error line) longer than this is not RESP."""

Reader = Callable[[Any, list[int]], list[object]]
"""Reads the replies of the commands for keys `idx` off a connection."""


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

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool | None]:
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffer lists")

        def read(conn: Any, idx: list[int]) -> list[object]:
            return _ValueReader(conn).read([buffers[i] for i in idx])

        replies = self._batch(keys, lambda i: [_command(b"GET", keys[i])], read)
        return [r if isinstance(r, bool) else None for r in replies]

    def put(
        self, keys: Sequence[bytes], values: Sequence[Chunks], ttl: float | None = None
    ) -> list[bool]:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if ttl is not None and not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl}")
        head, tail = b"*3\r\n$3\r\nSET\r\n", _CRLF
        if ttl is not None:
            head = b"*5\r\n$3\r\nSET\r\n"
            tail += _bulk(b"PX") + _bulk(str(math.ceil(ttl * 1000)).encode())

        def pack(i: int) -> list[Piece]:
            pieces = values[i]
            size = sum(piece_bytes(p) for p in pieces)
            return [head + _bulk(keys[i]) + b"$%d\r\n" % size, *pieces, tail]

        return [r == b"OK" for r in self._batch(keys, pack)]

    def heads(self, keys: Sequence[bytes], nbytes: int) -> list[bytes | None]:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        last = str(nbytes - 1).encode()
        replies = self._batch(keys, lambda i: [_command(b"GETRANGE", keys[i], b"0", last)])
        return [r if isinstance(r, bytes) and len(r) == nbytes else None for r in replies]

    def delete(self, keys: Sequence[bytes]) -> int:
        replies = self._batch(keys, lambda i: [_command(b"UNLINK", keys[i])])
        return sum(r for r in replies if isinstance(r, int))

    def ping(self) -> None:
        ping: Callable[[int], list[Piece]] = lambda _: [_command(b"PING")]  # noqa: E731
        pings = [(pool, [0], ping) for pool in self._pools()]
        for (reply,) in self._exchanged(pings, _replies):
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

    def _batch(
        self, keys: Sequence[bytes], pack: Callable[[int], list[Piece]], read: Reader | None = None
    ) -> list[object]:
        """Pipeline one command per key (pieces from `pack(index)`) to the
        server(s) holding the keys; the replies in key order (a
        ResponseError where a command failed), read by `read` (default:
        redis-py's parser). Raises RemoteUnavailable on a connection error
        or timeout."""
        if not keys:
            return []
        groups = self._route(keys)
        reader = read or _replies
        exchanges = [(pool, idx, pack) for pool, idx in groups]
        out: list[object] = [None] * len(keys)
        for (_, idx), replies in zip(groups, self._exchanged(exchanges, reader), strict=True):
            for i, reply in zip(idx, replies, strict=True):
                out[i] = reply
        if any(isinstance(r, ResponseError) and _is_redirect(r) for r in out):
            self._refresh = True
        return out

    def _exchanged(
        self,
        exchanges: list[tuple[redis.ConnectionPool, list[int], Callable[[int], list[Piece]]]],
        read: Reader,
    ) -> list[list[Any]]:
        """`_exchange`; in a cluster, a node that cannot be reached has the
        slot map read again before the next op (and ping): after a failover
        the old primary's address only ever failed, and the tier stayed
        offline until the sidecar restarted."""
        try:
            return _exchange(exchanges, read)
        except RemoteUnavailable:
            if self.cluster:
                self._refresh = True
            raise

    def _route(self, keys: Sequence[bytes]) -> list[tuple[redis.ConnectionPool, list[int]]]:
        if not self.cluster:
            assert self._pool is not None
            return [(self._pool, list(range(len(keys))))]
        cluster = self._topology()
        groups: dict[str, tuple[redis.ConnectionPool, list[int]]] = {}
        try:
            for i, key in enumerate(keys):
                node = cluster.get_node_from_key(key)  # type: ignore[no-untyped-call]
                if node.name not in groups:
                    conn = cluster.get_redis_connection(node)
                    groups[node.name] = (conn.connection_pool, [])
                groups[node.name][1].append(i)
        except (redis.RedisError, RedisClusterException) as err:  # a slot no node covers
            raise RemoteUnavailable(f"{self.describe()}: {err}") from None
        return list(groups.values())

    def _pools(self) -> list[redis.ConnectionPool]:
        if not self.cluster:
            assert self._pool is not None
            return [self._pool]
        cluster = self._topology()
        primaries = cluster.get_primaries()  # type: ignore[no-untyped-call]
        return [cluster.get_redis_connection(n).connection_pool for n in primaries]

    def _topology(self) -> RedisCluster:
        """The cluster client, created (or its slot map refreshed) on demand."""
        with self._lock:
            try:
                if self._cluster is None:
                    self._cluster = RedisCluster.from_url(  # type: ignore[no-untyped-call]
                        self.url, **self._options
                    )
                    self._refresh = False
                elif self._refresh:
                    # Asks every node it has known, not only the URL's (maybe the dead one).
                    self._cluster.nodes_manager.initialize()  # type: ignore[no-untyped-call]
                    self._refresh = False
            except (*_DOWN, redis.RedisError, RedisClusterException) as err:
                raise RemoteUnavailable(f"{self.describe()}: {err}") from None
            return self._cluster


SEND_GROUP_BYTES = 1 << 20
"""Commands are packed and sent in groups of about this many bytes, so the
first bytes leave before the last values are made; a `Later` piece ends a
group too (it is made once everything before it has been sent)."""


def _exchange(
    exchanges: list[tuple[redis.ConnectionPool, list[int], Callable[[int], list[Piece]]]],
    read: Reader,
) -> list[list[Any]]:
    """For each (pool, key indexes idx, pack): send the commands
    `pack(i)` gives for each i of idx on one connection of the pool, then
    read their replies with `read`. Every server's commands are sent before
    any reply is read, so the servers of a cluster work at once. Raises
    RemoteUnavailable (dropping the connections) on a connection error or
    timeout, or on a reply that is not what was asked for."""
    held: list[tuple[redis.ConnectionPool, Any]] = []
    ok = False
    try:
        for pool, idx, pack in exchanges:
            conn = pool.get_connection()
            held.append((pool, conn))
            group: list[Chunk] = []
            size = 0
            for i in idx:
                for piece in pack(i):
                    if isinstance(piece, Later):
                        if group:
                            _send(conn, _coalesce(group))
                            group, size = [], 0
                        piece = piece.made()
                    nbytes = memoryview(piece).nbytes
                    if nbytes:
                        group.append(piece)
                        size += nbytes
                if size >= SEND_GROUP_BYTES:
                    _send(conn, _coalesce(group))
                    group, size = [], 0
            if group:
                _send(conn, _coalesce(group))
        replies = [read(conn, idx) for (_, conn), (_, idx, _) in zip(held, exchanges, strict=True)]
        ok = True
        return replies
    except (*_DOWN, _NotResp) as err:
        raise RemoteUnavailable(str(err)) from None
    finally:
        for pool, conn in held:
            if not ok:
                conn.disconnect()  # replies may be left unread: never reuse it
            pool.release(conn)


def _replies(conn: Any, idx: list[int]) -> list[object]:
    """The next len(idx) replies on `conn`, parsed by redis-py; a failed
    command's is its ResponseError."""
    replies: list[object] = []
    for _ in idx:
        try:
            replies.append(conn.read_response(disable_decoding=True))
        except ResponseError as err:  # this command failed; the next replies follow
            replies.append(err)
    return replies


class _NotResp(Exception):
    """A reply that is not a GET's: the connection is out of step."""


def _error(message: bytes) -> ResponseError:
    """An error reply, classified as redis-py classifies it. The ones that
    say the server cannot serve at all (LOADING, NOAUTH, max clients: a
    redis ConnectionError) are raised, so the batch fails as unavailable;
    the others (WRONGTYPE, MOVED, ...) fail their key only."""
    text = message.decode(errors="replace")
    try:
        err: ResponseError = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
    except Exception:  # a malformed MOVED / ASK: keep it as it came
        err = ResponseError(text)
    if isinstance(err, redis.ConnectionError):
        raise err
    return err


class _ValueReader:
    """GET replies read off a redis-py connection's socket. Each value of
    the expected size is received straight into its buffers; headers and
    the bytes that arrive with them pass through a small scratch buffer.
    The connection's own parser has nothing buffered (the pool checks that
    before it hands a connection out), and every byte received is consumed
    here, so the connection stays in step for the next command."""

    def __init__(self, conn: Any) -> None:
        self._sock = conn._sock
        if self._sock is None:
            raise redis.ConnectionError("the connection is closed")
        self._buf = bytearray(_SCRATCH)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0

    def read(self, buffers: list[Buffers]) -> list[object]:
        """One reply per entry of `buffers`: True (read into them), False
        (a value of another size, skipped), None (no value) or the
        ResponseError the server sent."""
        out = [self._reply(bufs) for bufs in buffers]
        if self._lo != self._hi:
            raise _NotResp(f"{self._hi - self._lo} byte(s) past the last reply")
        return out

    def _reply(self, bufs: Buffers) -> object:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return _error(rest)
        if kind == b"_":  # RESP3's null (a URL with protocol=3)
            return None
        if kind != b"$" or not (rest.isdigit() or rest == b"-1"):
            raise _NotResp(f"a GET answered {line[:40]!r}")
        size = int(rest)
        if size < 0:
            return None
        if size != sum(b.nbytes for b in bufs):
            self._skip(size)
            self._crlf()
            return False
        for b in bufs:
            self._into(b)
        self._crlf()
        return True

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._lo, self._hi)
            if end >= 0:
                line = bytes(self._view[self._lo : end])
                self._lo = end + 2
                return line
            if self._hi - self._lo > _MAX_LINE:
                raise _NotResp("a reply header with no end of line")
            self._fill()

    def _crlf(self) -> None:
        while self._hi - self._lo < 2:
            self._fill()
        if self._view[self._lo : self._lo + 2].tobytes() != b"\r\n":
            raise _NotResp("a bulk value not followed by CRLF")
        self._lo += 2

    def _fill(self) -> None:
        """Receive more into the scratch buffer, after what is unread."""
        if self._lo:
            left = self._hi - self._lo
            self._buf[:left] = self._view[self._lo : self._hi]
            self._lo, self._hi = 0, left
        got = self._sock.recv_into(self._view[self._hi :])
        if not got:
            raise redis.ConnectionError("the server closed the connection")
        self._hi += got

    def _into(self, dst: memoryview) -> None:
        """Fill `dst`: first from the scratch buffer, the rest from the socket."""
        take = min(dst.nbytes, self._hi - self._lo)
        dst[:take] = self._view[self._lo : self._lo + take]
        self._lo += take
        while take < dst.nbytes:
            got = self._sock.recv_into(dst[take:])
            if not got:
                raise redis.ConnectionError("the server closed the connection")
            take += got

    def _skip(self, n: int) -> None:
        while n:
            if self._lo == self._hi:
                self._fill()
            step = min(n, self._hi - self._lo)
            self._lo += step
            n -= step


def _send(conn: Any, chunks: list[Chunk]) -> None:
    """Send the chunks on the connection's socket (redis-py's
    send_packed_command makes one sendall per chunk). TLS sockets have no
    sendmsg: there, one sendall per chunk."""
    sock = conn._sock
    if sock is None:
        raise redis.ConnectionError("the connection is closed")
    if isinstance(sock, ssl.SSLSocket):
        for chunk in chunks:
            sock.sendall(chunk)
    else:
        send_buffers(sock, chunks)


def send_buffers(sock: socket.socket, chunks: Sequence[Chunk]) -> None:
    """Send every chunk, in order, with sendmsg of up to IOV_MAX of them at
    a time (the kernel gathers them; nothing is joined here)."""
    views = [memoryview(c).cast("B") for c in chunks]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + _IOV_MAX])
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


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
    """MOVED or ASK: redis-py's parsers give them their own classes (and
    strip the word from the message)."""
    return isinstance(err, AskError) or str(err).startswith(("MOVED", "ASK"))
