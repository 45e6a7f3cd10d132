"""The sidecar-side ops of plans, run on the tiers' worker pools.

Each lower tier brings a `TierOps`: which op kinds it runs, on which
`IoPool`, and how one op becomes jobs (`sidecar/tiers/ssd/ops.py`,
`sidecar/tiers/remote/ops.py`). The control loop calls `pump(plan)` whenever a
plan may have ops whose dependencies are all done (after it was created,
after an engine reported, after another sidecar op landed); `pump` submits
them. `collect(pool)` applies a pool's results on the loop's thread:

- success completes the op in the cache;
- a failed write (H2DISK, H2REMOTE) is skipped: those blocks are simply not
  cached in that tier, and the rest of the plan goes on;
- a failed read fails its plan. A read whose blocks fail their checksum (or
  are gone from the store) drops them, and the blocks below them, from that
  tier's index first, so the next attempt loads the good prefix.

A plan with sidecar ops in flight is never rolled back at once: its slots
are in use by a thread. `cancel(plan_id)` rolls it back when its last op
returns (and submits nothing more of it meanwhile).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

from contract.ids import BlockKeys
from contract.ops import OpKind
from shm.layout import BlockLayout
from shm.pool import ShmPool
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.graph import TransferOp
from sidecar.control.node import RadixNode
from sidecar.control.plan import Plan
from sidecar.control.planner import GlobalCacheEngine
from sidecar.metrics.latency import LatencyHistogram
from sidecar.tiers.io_pool import IoPool

log = logging.getLogger("kvsidecar")

STORE_OPS = frozenset({OpKind.H2DISK, OpKind.H2REMOTE})
Job = Callable[[int, int], Any]
"""Runs blocks [lo, hi) of an op on a worker thread."""


class BadBlocks(Exception):
    """Blocks of a read that must not be served: they failed their key or
    checksum (`corrupt`), or the store no longer has them or cannot read
    them (`missing`)."""

    def __init__(self, failed: list[BlockKeys], corrupt: int, missing: int = 0) -> None:
        super().__init__(f"{corrupt} block(s) failed their checksum, {missing} missing")
        self.failed = failed
        """The key path of every block that failed."""
        self.corrupt = corrupt
        self.missing = missing


class OpToken(NamedTuple):
    plan_id: int
    op_id: int


class TierOps(Protocol):
    tier: str
    kinds: frozenset[OpKind]
    pool: IoPool
    counters: Counter[str]

    @property
    def latency(self) -> Mapping[str, LatencyHistogram]:
        """Seconds each job took on its thread, per kind of job (read, write...)."""

    def parts(self, op: TransferOp) -> int:
        """How many parts (ranges of its blocks, each a job on a thread of
        `pool`) the op is split into, at most; >= 1."""
        ...

    def job(self, op: TransferOp, tier: CacheEngine, node: RadixNode) -> Job:
        """The op as a job over a range of its blocks. Runs on the loop's
        thread; the job it returns runs on a worker thread."""
        ...

    def record_failure(self, error: BaseException) -> None:
        """Count and log a failed op (on the loop's thread)."""
        ...

    def drop(self, tier: CacheEngine, prefixes: list[BlockKeys]) -> None:
        """Remove blocks that failed a read (and what hangs below them)."""
        ...


class DataPlane:
    def __init__(
        self,
        cache: GlobalCacheEngine,
        pool: ShmPool,
        layout: BlockLayout,
        tiers: Iterable[TierOps],
        on_plan_end: Callable[[int, bool], None],
    ) -> None:
        self.cache = cache
        self.pool = pool
        self.layout = layout
        self.tiers = {ops.tier: ops for ops in tiers}
        self._by_kind = {kind: ops for ops in self.tiers.values() for kind in ops.kinds}
        self._on_plan_end = on_plan_end
        """Called with (plan_id, ok) when a plan this data plane ran ends."""
        self.plans: dict[int, Plan] = {}
        self._submitted: dict[int, set[int]] = {}
        self._running: Counter[int] = Counter()
        self._failed: set[int] = set()
        self._parts_left: dict[OpToken, int] = {}
        self._op_errors: dict[OpToken, list[BaseException]] = {}
        self._bad: dict[int, list[tuple[TransferOp, BadBlocks]]] = {}
        self.counters: Counter[str] = Counter()

    @property
    def pools(self) -> list[IoPool]:
        return [ops.pool for ops in self.tiers.values()]

    def busy(self, plan_id: int) -> bool:
        return self._running[plan_id] > 0

    @property
    def in_flight(self) -> int:
        return sum(self._running.values())

    def adopt(self, plan: Plan) -> None:
        """Track a plan with sidecar-side ops and start what can start."""
        if any(op.kind in self._by_kind for op in plan.graph.ops):
            self.plans[plan.plan_id] = plan
            self._submitted.setdefault(plan.plan_id, set())
            self.pump(plan.plan_id)

    def pump(self, plan_id: int) -> None:
        plan = self.plans.get(plan_id)
        if plan is None:
            return
        submitted = self._submitted[plan_id]
        for op in plan.graph.ops:
            ops = self._by_kind.get(op.kind)
            if ops is None or op.op_id in submitted:
                continue
            if not all(self.cache.is_done(plan_id, d) for d in op.deps):
                continue
            submitted.add(op.op_id)
            target = self.cache.op_target(plan_id, op.op_id)
            assert target is not None, "a sidecar op always fills a node"
            job = ops.job(op, *target)
            ranges = split(op.num_blocks, ops.parts(op))
            token = OpToken(plan_id, op.op_id)
            self._parts_left[token] = len(ranges)
            self._running[plan_id] += len(ranges)
            for lo, hi in ranges:
                ops.pool.submit(token, _part(job, lo, hi))

    def collect(self, pool: IoPool) -> None:
        """Apply every op result `pool` has sent back."""
        for done in pool.collect():
            self._apply(done.token, done.error)

    def _apply(self, token: OpToken, error: BaseException | None) -> None:
        plan_id = token.plan_id
        self._running[plan_id] -= 1
        if not self._running[plan_id]:
            del self._running[plan_id]
        if error is not None:
            self._op_errors.setdefault(token, []).append(error)
        self._parts_left[token] -= 1
        if self._parts_left[token]:
            return  # the op's other parts are still running
        del self._parts_left[token]
        error = _merge(self._op_errors.pop(token, []))
        plan = self.plans.get(plan_id)
        if plan is None:
            return
        op = plan.graph.ops[token.op_id]
        if error is not None:
            self._by_kind[op.kind].record_failure(error)
            if isinstance(error, BadBlocks):
                self._bad.setdefault(plan_id, []).append((op, error))
        if plan_id not in self._failed and (error is None or op.kind in STORE_OPS):
            self.counters["ops_done" if error is None else "ops_skipped"] += 1
            finish = self.cache.complete if error is None else self.cache.skip
            if finish(plan_id, token.op_id):
                self._end(plan_id, ok=True)
            else:
                self.pump(plan_id)
            return
        self._failed.add(plan_id)
        if not self.busy(plan_id):  # nothing of it left on a thread: roll it back
            self._failed.discard(plan_id)
            self.cache.cancel(plan_id)
            for bad_op, bad in self._bad.pop(plan_id, []):
                ops = self._by_kind[bad_op.kind]
                ops.drop(self.cache.lower[ops.tier], bad.failed)
            self._end(plan_id, ok=False)

    def ended(self, plan_id: int) -> None:
        """An engine's report ended a plan this data plane ran (its own ops
        had all landed first): stop tracking it, as when the last op is ours."""
        if plan_id in self.plans:
            self._end(plan_id, ok=True)

    def cancel(self, plan_id: int) -> None:
        """The plan's owner gave it up (an engine cancelled, failed or left).
        Rolled back now if none of its ops is on a thread, else as soon as
        the last one returns."""
        if self.busy(plan_id):
            self._failed.add(plan_id)
            return
        self.cache.cancel(plan_id)
        self.plans.pop(plan_id, None)
        self._submitted.pop(plan_id, None)
        self._bad.pop(plan_id, None)

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


def staged_keys(tier: CacheEngine, node: RadixNode, dst: Iterable[int]) -> list[BlockKeys]:
    """For a load into the staged CPU `node`: the key path (root to block)
    of the block landing in each CPU slot of `dst`. Each block's key is
    found from its slot's position in the node."""
    path, _ = tier.index.path(node)
    base = len(path) - len(node)
    position = {int(s): i for i, s in enumerate(node.slots.tolist())}
    return [BlockKeys(path[: base + position[int(c)] + 1]) for c in dst]


def drop_blocks(tier: CacheEngine, prefixes: list[BlockKeys]) -> list[int]:
    """Remove each prefix's last block and everything below it from `tier`,
    where nothing there is in use; returns the slots freed."""
    freed: list[int] = []
    for keys in prefixes:
        if tier.match(keys).num_blocks != len(keys):
            continue  # already gone with an earlier one
        try:
            tier.index.check_removable(keys)
        except ValueError:
            continue  # another plan uses it: the next read fails it again
        removed = tier.index.remove(keys)
        tier.mempool.free(removed)
        freed += removed.tolist()
    return freed


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """Ranges [lo, hi) covering n blocks in at most `parts` parts of equal
    size (the last may be smaller)."""
    step = max(1, -(-n // parts))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _part(job: Job, lo: int, hi: int) -> Callable[[], Any]:
    return lambda: job(lo, hi)


def _merge(errors: list[BaseException]) -> BaseException | None:
    """One error for an op from its parts' errors: any other error wins over
    bad blocks, which are pooled."""
    if not errors:
        return None
    for err in errors:
        if not isinstance(err, BadBlocks):
            return err
    bad = [e for e in errors if isinstance(e, BadBlocks)]
    return BadBlocks(
        [k for e in bad for k in e.failed],
        sum(e.corrupt for e in bad),
        sum(e.missing for e in bad),
    )
