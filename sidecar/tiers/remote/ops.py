"""REMOTE2H and H2REMOTE: remote-store reads and writes of plans, run on the
remote worker pool.

Each part of an op is one pipelined batch on one connection: a read is
split over every thread of the pool, a write over `write_streams` of them.
Writes send each block straight from its shm slot; reads receive each
value straight into its slot and check it there, and a block that fails
is dropped with its slot (BadBlocks) before anything can load it. Socket
I/O releases the GIL, so the pool's threads overlap their round trips.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable

from contract.ids import KEY_BYTES, BlockKeys
from contract.ops import OpKind
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.graph import TransferOp
from sidecar.control.node import RadixNode
from sidecar.metrics.latency import SharedLatencyHistogram, timed
from sidecar.tiers.dataplane import BadBlocks, Job, drop_blocks, staged_keys
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.remote.connector import RemoteError, RemoteUnavailable
from sidecar.tiers.remote.store import ReadResult, RemoteStore

log = logging.getLogger("kvsidecar")


class RemoteOps:
    tier = "remote"
    kinds = frozenset({OpKind.REMOTE2H, OpKind.H2REMOTE})

    def __init__(
        self,
        store: RemoteStore,
        pool: IoPool,
        shm: ShmPool,
        layout: BlockLayout,
        on_unavailable: Callable[[BaseException], None],
        *,
        write_streams: int = 1,
    ) -> None:
        if write_streams < 1:
            raise ValueError(f"write_streams must be >= 1, got {write_streams}")
        self.store = store
        self.pool = pool
        self.shm = shm
        self.layout = layout
        self.on_unavailable = on_unavailable
        """Called on the loop's thread when an op found the store down."""
        self.write_streams = min(write_streams, pool.threads)
        self.counters: Counter[str] = Counter()
        self.latency = {"get": SharedLatencyHistogram(), "put": SharedLatencyHistogram()}

    def parts(self, op: TransferOp) -> int:
        """A write goes out on `write_streams` connections: parallel writers
        to one server slow each other down (docs/sidecar.md#measured); a
        read uses every thread (parsing and checking replies is the client's
        work, and it runs in parallel)."""
        return self.write_streams if op.kind is OpKind.H2REMOTE else self.pool.threads

    def job(self, op: TransferOp, tier: CacheEngine, node: RadixNode) -> Job:
        stride = self.layout.slot_stride
        if op.kind is OpKind.H2REMOTE:
            kb = node.key_bytes  # the remote node this write fills, block by block
            keys = [kb[i : i + KEY_BYTES] for i in range(0, len(kb), KEY_BYTES)]
            sources = self.shm.slot_views(op.src, stride)
            # A namespace's TTL holds in the store too: a value another host
            # (or this one, after a restart) finds there is never older.
            ttl = tier.index.ttl(node.ns)

            def write(lo: int, hi: int) -> None:
                stored = self.store.write(keys[lo:hi], sources[lo:hi], ttl)
                if not all(stored):
                    refused = stored.count(False)
                    raise RemoteError(f"the store refused {refused} of {hi - lo} block(s)")

            return timed(self.latency["put"], write)
        paths = staged_keys(tier, node, op.dst)
        keys = [p[-1].tobytes() for p in paths]
        targets = self.shm.slot_views(op.dst, stride)

        def read(lo: int, hi: int) -> None:
            results = self.store.read(keys[lo:hi], targets[lo:hi])
            bad = [lo + j for j, r in enumerate(results) if r is not ReadResult.HIT]
            if not bad:
                return
            corrupt = [keys[i] for i in bad if results[i - lo] is ReadResult.CORRUPT]
            if corrupt:  # a bad value would fail every host: remove it from the store
                with contextlib.suppress(RemoteError):
                    self.store.delete(corrupt)
            raise BadBlocks([paths[i] for i in bad], len(corrupt), len(bad) - len(corrupt))

        return timed(self.latency["get"], read)

    def record_failure(self, error: BaseException) -> None:
        if isinstance(error, BadBlocks):
            self.counters["checksum_failures"] += error.corrupt
            self.counters["missing_blocks"] += error.missing
            log.warning(
                "remote: %d block(s) failed their checksum, %d gone from the store; dropped",
                error.corrupt,
                error.missing,
            )
        elif isinstance(error, RemoteUnavailable):
            self.counters["unavailable_errors"] += 1
            self.on_unavailable(error)
        else:
            self.counters["errors"] += 1
            log.error("remote op failed, the blocks are not cached there: %r", error)

    def drop(self, tier: CacheEngine, prefixes: list[BlockKeys]) -> None:
        drop_blocks(tier, prefixes)
