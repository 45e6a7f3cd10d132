"""The sidecar-side ops of plans: SSD reads and writes, run on the I/O pool.

The control loop calls `pump(plan)` whenever a plan may have ops whose
dependencies are all done (after it was created, after an engine reported,
after another sidecar op landed); `pump` submits them. `collect` applies the
results on the loop's thread: success completes the op in the cache; a
failed write fails its plan (the block is simply not cached on SSD); a read
whose block fails its key or checksum drops that block (and the blocks
below it, unreachable without it) from the SSD tier, and fails the plan.

A plan with sidecar ops in flight is never cancelled: its slots are in use
by a thread. `busy(plan_id)` tells the owner so.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.control.graph import OpKind, TransferOp
from sidecar.control.ids import BlockKeys
from sidecar.control.plan import Plan
from sidecar.control.planner import GlobalCacheEngine
from sidecar.ssd import SsdStore
from sidecar.workers import Done, IoPool

log = logging.getLogger("kvsidecar")

SIDECAR_OPS = frozenset({OpKind.DISK2H, OpKind.H2DISK})


class ChecksumMismatch(Exception):
    def __init__(self, failed: list[BlockKeys]) -> None:
        super().__init__(f"{len(failed)} block(s) failed their key or checksum")
        self.failed = failed
        """The key path of every block that failed."""


class DataPlane:
    def __init__(
        self,
        cache: GlobalCacheEngine,
        pool: ShmPool,
        layout: BlockLayout,
        ssd: SsdStore,
        io: IoPool,
        on_plan_end: Callable[[int, bool], None],
    ) -> None:
        self.cache = cache
        self.pool = pool
        self.layout = layout
        self.ssd = ssd
        self.io = io
        self._on_plan_end = on_plan_end
        """Called with (plan_id, ok) when a plan this data plane ran ends."""
        self.plans: dict[int, Plan] = {}
        self._submitted: dict[int, set[int]] = {}
        self._running: Counter[int] = Counter()
        self._failed: set[int] = set()
        self._parts_left: dict[tuple[int, int], int] = {}
        self._op_errors: dict[tuple[int, int], list[BaseException]] = {}
        self.counters: Counter[str] = Counter()

    def busy(self, plan_id: int) -> bool:
        return self._running[plan_id] > 0

    @property
    def in_flight(self) -> int:
        return sum(self._running.values())

    def adopt(self, plan: Plan) -> None:
        """Track a plan with sidecar-side ops and start what can start."""
        if any(op.kind in SIDECAR_OPS for op in plan.graph.ops):
            self.plans[plan.plan_id] = plan
            self._submitted.setdefault(plan.plan_id, set())
            self.pump(plan.plan_id)

    def pump(self, plan_id: int) -> None:
        plan = self.plans.get(plan_id)
        if plan is None:
            return
        submitted = self._submitted[plan_id]
        for op in plan.graph.ops:
            if op.kind not in SIDECAR_OPS or op.op_id in submitted:
                continue
            if not all(self.cache.is_done(plan_id, d) for d in op.deps):
                continue
            submitted.add(op.op_id)
            parts = self._jobs(plan_id, op)
            self._parts_left[(plan_id, op.op_id)] = len(parts)
            self._running[plan_id] += len(parts)
            for job in parts:
                self.io.submit((plan_id, op.op_id), job)

    def _jobs(self, plan_id: int, op: TransferOp) -> list[Callable[[], Any]]:
        """The op as jobs of a few blocks each, so that one large op keeps
        every I/O thread busy."""
        job = self._job(plan_id, op)
        n = op.num_blocks
        step = max(1, -(-n // self.io.threads))
        return [_part(job, i, min(n, i + step)) for i in range(0, n, step)]

    def _job(self, plan_id: int, op: TransferOp) -> Callable[[int, int], Any]:
        target = self.cache.op_target(plan_id, op.op_id)
        assert target is not None, "a sidecar op always fills a node"
        tier, node = target
        stride = self.layout.slot_stride
        if op.kind is OpKind.H2DISK:
            keys, parents, first = _chain_of(node)
            sources = [self.pool.slot_view(int(s), stride) for s in op.src]

            def write(lo: int, hi: int) -> None:
                for i in range(lo, hi):
                    block = memoryview(sources[i])
                    self.ssd.write(int(op.dst[i]), block, keys[i], parents[i], first and i == 0)

            return write
        # DISK2H into the staged CPU node: each block's key is found from its
        # CPU slot's position in that node; its depth locates it on SSD.
        path, _ = tier.index.path(node)
        base = len(path) - len(node)
        position = {int(s): i for i, s in enumerate(node.slots.tolist())}
        depths = [base + position[int(c)] + 1 for c in op.dst]
        raw = path.tobytes()
        keys = [raw[16 * (d - 1) : 16 * d] for d in depths]
        targets = [self.pool.slot_view(int(c), stride) for c in op.dst]

        def read(lo: int, hi: int) -> None:
            failed = [
                BlockKeys(path[: depths[i]])
                for i in range(lo, hi)
                if not self.ssd.read(int(op.src[i]), memoryview(targets[i]), keys[i])
            ]
            if failed:
                raise ChecksumMismatch(failed)

        return read

    def collect(self) -> None:
        """Apply every result the I/O threads have sent back."""
        for done in self.io.collect():
            plan_id, op_id = done.token
            self._running[plan_id] -= 1
            if not self._running[plan_id]:
                del self._running[plan_id]
            if done.error is not None:
                self._op_errors.setdefault((plan_id, op_id), []).append(done.error)
            self._parts_left[(plan_id, op_id)] -= 1
            if self._parts_left[(plan_id, op_id)]:
                continue  # the op's other parts are still running
            del self._parts_left[(plan_id, op_id)]
            error = _merge(self._op_errors.pop((plan_id, op_id), []))
            done = Done(done.token, None, error)
            if plan_id not in self.plans:
                continue
            if done.error is None and plan_id not in self._failed:
                self.counters["ops_done"] += 1
                if self.cache.complete(plan_id, op_id):
                    self._end(plan_id, ok=True)
                else:
                    self.pump(plan_id)
                continue
            if done.error is not None:
                self._record_failure(done.error)
            self._failed.add(plan_id)
            if not self.busy(plan_id):  # nothing of it left on a thread: roll it back
                self._failed.discard(plan_id)
                self.cache.cancel(plan_id)
                if isinstance(done.error, ChecksumMismatch):
                    self._drop_ssd_blocks(done.error.failed)
                self._end(plan_id, ok=False)

    def _record_failure(self, error: BaseException) -> None:
        if isinstance(error, ChecksumMismatch):
            self.counters["checksum_failures"] += len(error.failed)
            log.warning("SSD: %d block(s) failed their checksum; dropped", len(error.failed))
        else:
            self.counters["io_errors"] += 1
            log.error("SSD I/O failed, the blocks are not cached: %r", error)

    def _drop_ssd_blocks(self, prefixes: list[BlockKeys]) -> None:
        """Remove corrupted blocks, and what hangs below them, from the SSD tier."""
        tier = self.cache.lower["ssd"]
        for keys in prefixes:
            if tier.match(keys).num_blocks != len(keys):
                continue  # already gone with an earlier one
            try:
                tier.index.check_removable(keys)
            except ValueError:
                continue  # another plan uses it: the next read fails it again
            removed = tier.index.remove(keys)
            for slot in removed.tolist():
                self.ssd.drop(slot)
            tier.mempool.free(removed)

    def forget(self, plan_id: int) -> None:
        """The plan was cancelled by its owner (none of its sidecar ops ran)."""
        assert not self.busy(plan_id), "a plan with I/O in flight cannot be cancelled"
        self.plans.pop(plan_id, None)
        self._submitted.pop(plan_id, None)

    def abandon(self) -> None:
        """Shutdown: roll back plans whose sidecar ops never started; running
        ones finish on their threads (IoPool.close waits) and are dropped."""
        for plan_id in list(self.plans):
            if not self.busy(plan_id):
                self.cache.cancel(plan_id)
                self._end(plan_id, ok=False)

    def _end(self, plan_id: int, ok: bool) -> None:
        self.plans.pop(plan_id, None)
        self._submitted.pop(plan_id, None)
        self._on_plan_end(plan_id, ok)


def _part(job: Callable[[int, int], Any], lo: int, hi: int) -> Callable[[], Any]:
    return lambda: job(lo, hi)


def _merge(errors: list[BaseException]) -> BaseException | None:
    """One error for an op from its parts' errors: an I/O error wins over
    checksum failures, which are pooled."""
    if not errors:
        return None
    for err in errors:
        if not isinstance(err, ChecksumMismatch):
            return err
    return ChecksumMismatch([k for err in errors for k in err.failed])  # type: ignore[attr-defined]


def _chain_of(node: Any) -> tuple[list[bytes], list[bytes], bool]:
    """Keys of a node's blocks, each block's parent key, and whether the
    node's first block starts its sequence."""
    kb = node.key_bytes
    keys = [kb[i : i + 16] for i in range(0, len(kb), 16)]
    parent = node.parent
    first = parent is None or parent.parent is None
    head = b"\0" * 16 if first else parent.key_bytes[-16:]
    return keys, [head, *keys[:-1]], first
