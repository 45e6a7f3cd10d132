"""DISK2H and H2DISK: SSD reads and writes of plans, run on the SSD I/O pool.

Positional I/O releases the GIL, so an op split across `ssd_io_threads`
threads keeps them all busy; a writing thread keeps 2 MiB of writes in
flight through Linux AIO and hashes those blocks meanwhile
(`SsdStore.write_run`); a reading thread has the next block's read in
flight while it checks this one (`SsdStore.read_run`). Bytes move
straight between the file and the shm slot (O_DIRECT where the filesystem
has it).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from contract.ids import BlockKeys
from contract.ops import OpKind
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.graph import TransferOp
from sidecar.control.node import RadixNode
from sidecar.metrics.latency import SharedLatencyHistogram, timed
from sidecar.tiers.dataplane import BadBlocks, Job, drop_blocks, staged_keys
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.ssd.store import NO_TAG, ReadBlock, SsdStore, WriteBlock

log = logging.getLogger("kvsidecar")


class SsdOps:
    tier = "ssd"
    kinds = frozenset({OpKind.DISK2H, OpKind.H2DISK})

    def __init__(self, store: SsdStore, pool: IoPool, shm: ShmPool, layout: BlockLayout) -> None:
        self.store = store
        self.pool = pool
        self.shm = shm
        self.layout = layout
        self.counters: Counter[str] = Counter()
        self.latency = {"read": SharedLatencyHistogram(), "write": SharedLatencyHistogram()}

    def parts(self, op: TransferOp) -> int:
        return self.pool.threads  # positional reads and writes scale with threads

    def job(self, op: TransferOp, tier: CacheEngine, node: RadixNode) -> Job:
        stride = self.layout.slot_stride
        if op.kind is OpKind.H2DISK:
            keys, parents, first = chain_of(node)
            sources = self.shm.slot_views(op.src, stride)
            tag = self.store.ns_tags.get(node.ns, NO_TAG)

            def block(i: int) -> WriteBlock:
                dst = int(op.dst[i])
                return WriteBlock(dst, sources[i], keys[i], parents[i], first and i == 0, tag)

            def write(lo: int, hi: int) -> None:
                self.store.write_run([block(i) for i in range(lo, hi)])

            return timed(self.latency["write"], write)
        # DISK2H into the staged CPU node: a block's depth locates its key.
        paths = staged_keys(tier, node, op.dst)
        keys = [p[-1].tobytes() for p in paths]
        targets = self.shm.slot_views(op.dst, stride)

        def read(lo: int, hi: int) -> None:
            ok = self.store.read_run(
                [ReadBlock(int(op.src[i]), targets[i], keys[i]) for i in range(lo, hi)]
            )
            failed = [paths[lo + k] for k, good in enumerate(ok) if not good]
            if failed:  # dropped: none is served, and none is read again
                unreadable = ok.count(None)
                raise BadBlocks(failed, corrupt=len(failed) - unreadable, missing=unreadable)

        return timed(self.latency["read"], read)

    def record_failure(self, error: BaseException) -> None:
        if isinstance(error, BadBlocks):
            self.counters["checksum_failures"] += error.corrupt
            self.counters["io_errors"] += error.missing
            log.warning(
                "SSD: %d block(s) failed their checksum, %d could not be read (EIO); dropped",
                error.corrupt,
                error.missing,
            )
        else:
            self.counters["io_errors"] += 1
            log.error("SSD I/O failed, the blocks are not cached: %r", error)

    def drop(self, tier: CacheEngine, prefixes: list[BlockKeys]) -> None:
        for slot in drop_blocks(tier, prefixes):
            self.store.drop(slot)


def chain_of(node: Any) -> tuple[list[bytes], list[bytes], bool]:
    """Keys of a node's blocks, each block's parent key, and whether the
    node's first block starts its sequence."""
    kb = node.key_bytes
    keys = [kb[i : i + 16] for i in range(0, len(kb), 16)]
    parent = node.parent
    first = parent is None or parent.parent is None
    head = b"\0" * 16 if first else parent.key_bytes[-16:]
    return keys, [head, *keys[:-1]], first
