"""`kvsidecar bench remote`: the remote tier's reads and writes against raw redis-py.

For each block size (2 MiB and 256 KiB by default) it fills N shm slots
(one prefaulted POSIX shm pool, as in the sidecar) with random blocks and
times, on the same server and interleaved round by round:

- write: the remote tier's H2REMOTE path: `RemoteStore.write` straight from
  the slots (header + checksum, zero-copy SET), split into
  `--write-streams` pipelined batches (the sidecar's `remote_write_streams`)
  on an `IoPool` of `--threads` as the sidecar runs it;
- read: REMOTE2H: `RemoteStore.read` into other slots, each value verified,
  one batch per worker thread (as the sidecar splits reads);
- floor: the fastest of several raw clients doing the same SETs / GETs
  of the same number of values of the same size: redis-py pipelines on
  one connection (writes with both of its command packers, hiredis and
  the pure-Python one), and plain sockets split as the tier splits the
  work (`--threads` connections for reads, `--write-streams` for writes,
  on the same kind of thread pool): pipelined commands sent with one
  sendmsg of header and value buffers, replies read with recv_into
  straight into a preallocated buffer (a GET reply of a known size needs
  no parsing beyond checking its header). Each floor is in the JSON;
  `*_vs_floor` uses the fastest, `*_vs_redis_py` redis-py's pipelines only
  (what the tier was first measured against). A tier read receives each
  value into its slot as the raw GET does, and does more: it parses every
  reply's header, splits the value's own 32-byte header off, and checks it
  and the block's checksum.

GB/s = 1e9 B/s of block bytes; medians over --repeats; ratio = tier /
floor. Target: every ratio >= 0.8 (`targets` in the JSON:
`write.<block>`, `read.<block>`). Without --url a private `redis-server` (no persistence) is started
on a free loopback port and stopped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import redis
from redis.connection import Encoder, PythonRespSerializer

from bench.targets import Target, at_least, verdict
from cachesim.report import print_table, time_interleaved, write_json
from shm.pool import ShmPool
from sidecar.config import Config
from sidecar.tiers.dataplane import split
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.remote.redis import RedisConnector, send_buffers
from sidecar.tiers.remote.store import ReadResult, RemoteStore

TARGET_VS_FLOOR = 0.8


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "remote",
        help="remote-tier reads and writes against raw redis-py pipelines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", help="a running Redis/Valkey (default: start a private one)")
    p.add_argument("--block-kib", default="2048,256", help="block sizes in KiB (2048,256)")
    p.add_argument("--total-mib", type=int, default=None, help="bytes per batch (256)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (5)")
    p.add_argument("--threads", type=int, default=4, help="remote worker threads (4)")
    p.add_argument(
        "--write-streams",
        type=int,
        default=Config().remote_write_streams,
        help="batches one write is split into (the sidecar's remote_write_streams)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, for the test suite")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


@contextlib.contextmanager
def private_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not on PATH: install it or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvs-bench-redis-")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _python_packer_client(url: str) -> redis.Redis:
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, command_packer=packer))


class RawRedis:
    """The floor's plainest client: one socket per worker, RESP written by
    hand, values sent from and received into buffers without copies."""

    def __init__(self, url: str, count: int) -> None:
        parsed = redis.connection.parse_url(url)
        host, port = parsed.get("host", "127.0.0.1"), int(parsed.get("port", 6379))
        self.socks = [socket.create_connection((host, port)) for _ in range(count)]
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set(self, i: int, keys: list[bytes], values: list[bytes | memoryview]) -> None:
        sock, parts = self.socks[i], []
        for k, v in zip(keys, values, strict=True):
            parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, len(v)), v, b"\r\n"]
        send_buffers(sock, parts)
        _expect(sock, b"+OK\r\n" * len(keys))

    def get(self, i: int, keys: list[bytes], size: int, into: memoryview) -> None:
        sock = self.socks[i]
        sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        header = b"$%d\r\n" % size
        each = len(header) + size + 2
        want = into[: len(keys) * each]
        _recv_exactly(sock, want)
        if any(want[j * each : j * each + len(header)] != header for j in range(len(keys))):
            raise RuntimeError("a raw GET reply is not a value of the expected size")

    def close(self) -> None:
        for s in self.socks:
            s.close()


def _recv_exactly(sock: socket.socket, into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = sock.recv_into(into[got:])
        if not n:
            raise RuntimeError("redis closed the connection")
        got += n


def _expect(sock: socket.socket, reply: bytes) -> None:
    buf = bytearray(len(reply))
    _recv_exactly(sock, memoryview(buf))
    if buf != reply:
        raise RuntimeError(f"unexpected raw SET replies: {bytes(buf[:40])!r}")


def _on_pool(io: IoPool, jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run jobs on the pool and wait for all of them, as the sidecar's loop does."""
    for i, job in enumerate(jobs):
        io.submit(i, job)
    results: list[Any] = [None] * len(jobs)
    left = len(jobs)
    while left:
        select.select([io.fd], [], [])
        for done in io.collect():
            if done.error is not None:
                raise done.error
            results[done.token] = done.result
            left -= 1
    return results


def measure(
    url: str, block: int, total: int, repeats: int, threads: int, write_streams: int
) -> dict[str, Any]:
    n = max(threads, total // block)
    prefix = f"kvsbench.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(block)
    keys = [rng.bytes(16) for _ in range(n)]
    values = [rng.bytes(block) for _ in range(n)]
    floor_keys = [b"floor:%d" % i for i in range(n)]
    store = RemoteStore(RedisConnector(url, timeout=30.0), f"bench{os.getpid()}", block)
    default, python = redis.Redis.from_url(url), _python_packer_client(url)
    raw = RawRedis(url, max(threads, write_streams))
    io = IoPool("bench-remote", threads)
    read_parts, write_parts = split(n, threads), split(n, write_streams)  # as the sidecar
    reply_bytes = len(b"$%d\r\n" % block) + block + 2
    replies = memoryview(bytearray(n * reply_bytes))
    with ShmPool.create(prefix, 2 * n * block) as pool:
        src = [pool.slot_view(i, block) for i in range(n)]
        dst = [pool.slot_view(n + i, block) for i in range(n)]
        for i, v in enumerate(values):
            src[i][:] = np.frombuffer(v, dtype=np.uint8)

        def tier_write() -> None:
            jobs = [lambda a=a, b=b: store.write(keys[a:b], src[a:b]) for a, b in write_parts]
            _on_pool(io, jobs)

        def tier_read() -> None:
            jobs = [lambda a=a, b=b: store.read(keys[a:b], dst[a:b]) for a, b in read_parts]
            got = _on_pool(io, jobs)
            if any(r is not ReadResult.HIT for part in got for r in part):
                raise RuntimeError("a block written by the benchmark did not read back")

        def floor_write(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            for k, v in zip(floor_keys, values, strict=True):
                pipe.set(k, v)
            pipe.execute()

        def floor_read() -> None:
            pipe = default.pipeline(transaction=False)
            for k in floor_keys:
                pipe.get(k)
            pipe.execute()

        def raw_write() -> None:
            jobs = [
                lambda i=i, a=a, b=b: raw.set(i, floor_keys[a:b], values[a:b])
                for i, (a, b) in enumerate(write_parts)
            ]
            _on_pool(io, jobs)

        def raw_read() -> None:
            jobs = [
                lambda i=i, a=a, b=b: raw.get(
                    i, floor_keys[a:b], block, replies[a * reply_bytes : b * reply_bytes]
                )
                for i, (a, b) in enumerate(read_parts)
            ]
            _on_pool(io, jobs)

        fns: dict[str, Callable[[], None]] = {
            "floor_write_hiredis_packer": lambda: floor_write(default),
            "floor_write_python_packer": lambda: floor_write(python),
            "floor_write_raw": raw_write,
            "tier_write": tier_write,
            "floor_read_redis_py": floor_read,
            "floor_read_raw": raw_read,
            "tier_read": tier_read,
        }
        times = time_interleaved(fns, repeats)
        if not all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True)):
            raise RuntimeError("blocks read back differ from those written")
    io.close()
    raw.close()
    store.delete(keys)
    default.delete(*floor_keys)
    for c in (default, python, store.connector):
        c.close()
    gbps = {name: n * block / statistics.median(t) / 1e9 for name, t in times.items()}
    writes = ("floor_write_hiredis_packer", "floor_write_python_packer", "floor_write_raw")
    reads = ("floor_read_redis_py", "floor_read_raw")
    write_kind, read_kind = max(writes, key=gbps.get), max(reads, key=gbps.get)  # type: ignore[arg-type]
    return {
        "block_bytes": block,
        "blocks": n,
        "bytes": n * block,
        **{f"{name}_gbps": v for name, v in gbps.items()},
        "floor_write_gbps": gbps[write_kind],
        "floor_write_kind": write_kind,
        "floor_read_gbps": gbps[read_kind],
        "floor_read_kind": read_kind,
        "write_vs_floor": gbps["tier_write"] / gbps[write_kind],
        "read_vs_floor": gbps["tier_read"] / gbps[read_kind],
        # The issue's own rule: against redis-py's pipelines only.
        "write_vs_redis_py": gbps["tier_write"] / max(gbps[k] for k in writes[:2]),
        "read_vs_redis_py": gbps["tier_read"] / gbps["floor_read_redis_py"],
    }


def run(args: argparse.Namespace) -> int:
    try:
        sizes = [int(v) << 10 for v in args.block_kib.split(",") if v.strip()]
    except ValueError:
        print(f"--block-kib: expected KiB numbers, got {args.block_kib!r}", file=sys.stderr)
        return 2
    if not sizes or min(sizes) <= 0 or args.threads < 1 or args.write_streams < 1:
        print("--block-kib, --threads and --write-streams must be positive", file=sys.stderr)
        return 2
    streams = min(args.write_streams, args.threads)  # the sidecar's cap too
    total = (args.total_mib or (4 if args.quick else 256)) << 20
    repeats = args.repeats or (1 if args.quick else 5)
    try:
        server = contextlib.nullcontext(args.url) if args.url else private_server()
        with server as url:
            version = redis.Redis.from_url(url).info("server")["redis_version"]
            cases = {}
            for block in sizes:
                print(f"{block >> 10} KiB blocks: {total >> 20} MiB ...", file=sys.stderr)
                cases[f"{block >> 10}KiB"] = measure(
                    url, block, total, repeats, args.threads, streams
                )
    except (RuntimeError, redis.RedisError) as err:
        print(f"bench remote: {err}", file=sys.stderr)
        return 2
    rows = [
        (name, c["blocks"], c["tier_write_gbps"], c["floor_write_hiredis_packer_gbps"],
         c["floor_write_python_packer_gbps"], c["floor_write_raw_gbps"], c["write_vs_floor"],
         c["tier_read_gbps"], c["floor_read_redis_py_gbps"], c["floor_read_raw_gbps"],
         c["read_vs_floor"])
        for name, c in cases.items()
    ]  # fmt: skip
    print_table(
        ("block", "blocks", "write GB/s", "redis-py SET (hiredis)", "redis-py SET (python)",
         "raw SET", "write/floor", "read GB/s", "redis-py GET", "raw GET", "read/floor"),
        rows,
    )  # fmt: skip
    print(
        f"redis {version}, {args.threads} tier threads, writes on {streams} stream(s); "
        f"target >= {TARGET_VS_FLOOR} x floor"
    )
    goals = targets(cases)
    print(verdict(goals))
    if args.json:
        result = {
            "redis_version": version,
            "threads": args.threads,
            "write_streams": streams,
            "total_bytes_per_case": total,
            "repeats": repeats,
            "target_vs_floor": TARGET_VS_FLOOR,
            "write_vs_floor": {k: c["write_vs_floor"] for k, c in cases.items()},
            "read_vs_floor": {k: c["read_vs_floor"] for k, c in cases.items()},
            "write_vs_redis_py": {k: c["write_vs_redis_py"] for k, c in cases.items()},
            "read_vs_redis_py": {k: c["read_vs_redis_py"] for k, c in cases.items()},
            "quick": bool(args.quick),
            "cases": cases,
            "targets": goals,
        }
        write_json(args.json, result)
    return 0


def targets(cases: dict[str, dict[str, Any]]) -> dict[str, Target]:
    out: dict[str, Target] = {}
    for phase, verb in (("write", "SET"), ("read", "GET")):
        rule = f"tier {phase} GB/s / the fastest raw {verb} client's >= {TARGET_VS_FLOOR:g}"
        for name, c in cases.items():
            out[f"{phase}.{name}"] = at_least(c[f"{phase}_vs_floor"], TARGET_VS_FLOOR, rule)
    return out
