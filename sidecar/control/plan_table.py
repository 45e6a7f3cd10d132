"""PlanTable: the plans in flight and the life of each, op by op.

The bookkeeping half of `GlobalCacheEngine` (which makes the plans): ids,
completion in dependency order, skipping a failed write, cancelling, and
what each end releases. Every call that does not fit a plan raises
PlanError and changes nothing. Blocks of remote writes held against the
put quota come back when their op completes or their plan ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from sidecar.control.admission import PutQuota
from sidecar.control.graph import TransferGraph, TransferOp
from sidecar.control.plan import Plan, PlanError, PlanKind, RunningPlan

if TYPE_CHECKING:
    from sidecar.control.cache_engine import CacheEngine
    from sidecar.control.node import RadixNode


class PlanTable:
    def __init__(self, quota: PutQuota | None = None, first_id: int = 1) -> None:
        self.quota = quota
        """In-flight quota of remote writes, in blocks (None: unbounded)."""
        self._runs: dict[int, RunningPlan] = {}
        self._next_id = first_id

    @property
    def num_active_plans(self) -> int:
        return len(self._runs)

    def complete(self, plan_id: int, op_id: int) -> bool:
        """Op `op_id` of the plan is done; returns True when the plan ended.

        An unknown plan or op, an op done twice, or an op whose dependencies
        are not done raises PlanError and changes nothing.
        """
        run = self._run(plan_id)
        op = self._op(run, op_id)
        missing = [d for d in op.deps if d not in run.done]
        if missing:
            raise PlanError(f"plan {plan_id}: op {op_id} completed before its deps {missing}")
        run.mark_done(op_id)
        if self.quota is not None:
            self.quota.release_op(plan_id, op_id)
        if len(run.done) == len(run.plan.graph.ops):
            self._end(plan_id)
            return True
        return False

    def skip(self, plan_id: int, op_id: int) -> bool:
        """Write op `op_id` failed, but its plan goes on without it: the
        blocks it would have filled are dropped when the plan ends. Only an
        op no other op depends on can be skipped (PlanError otherwise).
        Returns True when the plan ended."""
        run = self._run(plan_id)
        op = self._op(run, op_id)
        if any(op_id in other.deps for other in run.plan.graph.ops):
            raise PlanError(f"plan {plan_id}: other ops depend on op {op_id}")
        missing = [d for d in op.deps if d not in run.done]
        if missing:  # checked before anything changes, as `complete` would refuse it
            raise PlanError(f"plan {plan_id}: op {op_id} skipped before its deps {missing}")
        run.waits = [w for w in run.waits if op_id not in w.ops]
        return self.complete(plan_id, op_id)

    def fail(self, plan_id: int, op_id: int) -> None:
        """Op `op_id` failed: the plan ends; what had not landed is dropped."""
        run = self._run(plan_id)
        self._op(run, op_id)
        self.cancel(plan_id)

    def cancel(self, plan_id: int) -> None:
        self._run(plan_id)
        self._end(plan_id)

    def _end(self, plan_id: int) -> None:
        self._runs.pop(plan_id).release()
        if self.quota is not None:
            self.quota.release_plan(plan_id)

    def op_target(self, plan_id: int, op_id: int) -> tuple[CacheEngine, RadixNode] | None:
        """The tier and node an unfinished op of a plan in flight fills."""
        run = self._run(plan_id)
        for wait in run.waits:
            if op_id in wait.ops:
                return wait.engine, wait.node
        return None

    def is_done(self, plan_id: int, op_id: int) -> bool:
        return op_id in self._run(plan_id).done

    def active_plan_ids(self) -> Iterator[int]:
        return iter(list(self._runs))

    def _start(self, kind: PlanKind) -> tuple[RunningPlan, TransferGraph]:
        graph = TransferGraph()
        run = RunningPlan(Plan(self._next_id, kind, graph))
        self._next_id += 1
        return run, graph

    def _launch(self, run: RunningPlan, graph: TransferGraph, **fields: object) -> Plan:
        plan = Plan(run.plan.plan_id, run.plan.kind, graph, **fields)  # type: ignore[arg-type]
        run.plan = plan
        if graph.ops:
            self._runs[plan.plan_id] = run
        else:
            run.release()
            if self.quota is not None:
                self.quota.release_plan(plan.plan_id)
        return plan

    def _run(self, plan_id: int) -> RunningPlan:
        run = self._runs.get(plan_id)
        if run is None:
            raise PlanError(f"no plan {plan_id} in flight")
        return run

    @staticmethod
    def _op(run: RunningPlan, op_id: int) -> TransferOp:
        ops = run.plan.graph.ops
        if not 0 <= op_id < len(ops):
            raise PlanError(f"plan {run.plan.plan_id} has no op {op_id}")
        if op_id in run.done:
            raise PlanError(f"plan {run.plan.plan_id}: op {op_id} already completed")
        return ops[op_id]
