"""GlobalCacheEngine: GET and PUT plans across the CPU, SSD and remote tiers.

GET(keys, gpu_blocks) loads the longest cached prefix. Fragment 1 is what the
CPU tier holds (H2D). Past it, fragment 2 comes from SSD and fragment 3 from
the remote tier, each staged into fresh CPU slots (DISK2H / REMOTE2H, then
H2D). The staged blocks join the CPU index, unready until they land.

PUT(keys, gpu_blocks) skips what the CPU tier has, stores the rest (D2H;
the longest prefix that fits when space is short), then writes down to SSD
and remote per the write policy:
- write_through: every PUT also writes what the lower tier lacks;
- write_through_selective: a block is written down once its CPU node has
  been hit `write_through_min_hits` times (checked on GET);
- write_back: a block is written down when it is evicted from the CPU tier;
  its CPU slot is reused only after the write has landed.

The remote tier follows AIBrix's rules for its L2 (`control/admission.py`):
it is read only when the double-get rule allows it, and its writes are
bounded by an in-flight quota (blocks past it are DENIED and counted). A
lower tier marked offline (`set_online`) is neither read nor written.

Every request carries a namespace id (`ns`, 0 when none): each block it
inserts in any tier joins that namespace and each allocation counts against
the namespace's quota in that tier. A TTL applies to every tier; GET and
PUT drop expired trees first, so fresh blocks can replace them.

Plans in flight are tracked by the `PlanTable` base (`control/plans.py`).
Every block a plan reads or writes stays locked until the plan ends; every
block it inserts stays unready until its op completes. Failing or cancelling
a plan drops what had not landed and releases the rest, so a half-written
block is never visible and no slot leaks.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

import numpy as np

from contract.ids import KEY_DTYPE, BlockKeys, GpuBlockIds
from contract.ops import OpKind
from sidecar.control.admission import DoubleGetRule, PutQuota
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.graph import TransferGraph
from sidecar.control.index import EvictedRun, IndexConflict, MatchResult
from sidecar.control.node import RadixNode
from sidecar.control.plan import (
    Plan,
    PlanKind,
    ReadyWait,
    RunningPlan,
    TierCounts,
)
from sidecar.control.plan_table import PlanTable


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


_LOAD_OP = {"ssd": OpKind.DISK2H, "remote": OpKind.REMOTE2H}
_STORE_OP = {"ssd": OpKind.H2DISK, "remote": OpKind.H2REMOTE}


class GlobalCacheEngine(PlanTable):
    def __init__(
        self,
        cpu: CacheEngine,
        ssd: CacheEngine | None = None,
        remote: CacheEngine | None = None,
        write_policy: str | WritePolicy = WritePolicy.WRITE_THROUGH,
        write_through_min_hits: int = 2,
        remote_rule: DoubleGetRule | None = None,
        remote_quota: int | None = None,
        first_plan_id: int = 1,
    ) -> None:
        self.cpu = cpu
        self.lower: dict[str, CacheEngine] = {}
        if ssd is not None:
            self.lower["ssd"] = ssd
        if remote is not None:
            self.lower["remote"] = remote
        self.write_policy = WritePolicy(write_policy)
        if write_through_min_hits < 1:
            raise ValueError(f"write_through_min_hits must be >= 1, got {write_through_min_hits}")
        self.write_through_min_hits = write_through_min_hits
        super().__init__(
            PutQuota(remote_quota) if remote_quota is not None else None, first_plan_id
        )
        self.remote_rule = remote_rule or DoubleGetRule()
        self.offline: set[str] = set()
        self._background: list[Plan] = []
        self._ttls: dict[int, float] = {}
        if self.write_policy is WritePolicy.WRITE_BACK and self.lower:
            cpu.evict_hook = self._write_back

    # ---- queries -------------------------------------------------------------

    def set_online(self, name: str, online: bool) -> None:
        """Mark a lower tier usable or not (its store is down): an offline
        tier is left out of lookups, GETs and writes until it is back."""
        if name not in self.lower:
            raise ValueError(f"no lower tier {name!r}")
        if online:
            self.offline.discard(name)
        else:
            self.offline.add(name)

    def lookup(self, keys: BlockKeys) -> TierCounts:
        """Ready prefix length in each tier a GET would read; changes nothing."""
        lower = {name: tier.match(keys).num_blocks for name, tier in self._online()}
        cpu = self.cpu.match(keys).num_blocks
        remote = lower.get("remote", 0)
        local = max(cpu, lower.get("ssd", 0))
        if not self.remote_rule.allows(len(keys) - local, len(keys)):
            remote = 0
        return TierCounts(cpu, lower.get("ssd", 0), remote)

    def filling_from_below(self, keys: BlockKeys) -> bool:
        """Whether blocks past the CPU tier's ready prefix of `keys` are in
        flight into it and a lower tier holds them: a staging under way
        (another load's, or an earlier part's of a load in parts), which a
        load of them waits for. The double-get rule is not asked: it decided
        when that staging began."""
        cpu = self.cpu.match(keys)
        if cpu.pending is None:  # nothing in flight (a tree past its TTL is present, not filling)
            return False
        return any(tier.match(keys).num_blocks > cpu.num_blocks for _, tier in self._online())

    def remote_probe_start(self, keys: BlockKeys) -> int | None:
        """Where a probe of the remote store for `keys` should start (the
        remote index's own prefix), or None when there is nothing to ask:
        no remote tier, offline, blocks past it being written right now, or
        the double-get rule says too little is missing locally."""
        remote = self.lower.get("remote")
        if remote is None or "remote" in self.offline:
            return None
        m = remote.match(keys)
        if m.num_present > m.num_blocks:
            return None
        local = [t.match(keys).num_blocks for name, t in self._online() if name != "remote"]
        have = max(m.num_blocks, self.cpu.match(keys).num_blocks, *local)
        return m.num_blocks if self.remote_rule.allows(len(keys) - have, len(keys)) else None

    def learn_remote(self, keys: BlockKeys, num_blocks: int, ns: int = 0) -> int:
        """The remote store holds keys[:num_blocks] (a probe found them, or
        another host saved them): the remote index adds what it lacked, ready.
        Returns the blocks added (fewer when its index is full of locked
        blocks, none when blocks there are in flight)."""
        remote = self.lower.get("remote")
        if remote is None or num_blocks <= 0:
            return 0
        prefix = BlockKeys(keys[:num_blocks])
        m = remote.match(prefix)
        if m.num_present > m.num_blocks or m.num_blocks >= num_blocks:
            return 0
        if m.node is not None:
            remote.lock(m.node)  # the allocation may evict: keep the prefix
        try:
            slots = remote.allocate(num_blocks - m.num_blocks, ns)
        finally:
            if m.node is not None:
                remote.unlock(m.node)
        if slots.size:
            end = m.num_blocks + slots.size
            remote.insert(BlockKeys(prefix[:end]), slots, ready=True, ns=ns)
        return int(slots.size)

    def drain_background(self) -> list[Plan]:
        """Write-back plans created by CPU evictions, for the sidecar's pools."""
        plans, self._background = self._background, []
        return plans

    # ---- GET ---------------------------------------------------------------------

    def get(
        self,
        keys: BlockKeys,
        gpu_blocks: GpuBlockIds,
        skip: int = 0,
        *,
        stage: bool = True,
        hit: bool = True,
        ns: int = 0,
        ready_at: Sequence[int] = (),
        end: int | None = None,
    ) -> Plan:
        """Plan loading keys[skip:matched] into gpu_blocks[skip:matched].

        The first `skip` blocks are already on the GPU; they are matched (a
        prefix is only usable whole) but not copied. With `stage=False` the
        plan serves the CPU tier's prefix only (no lower-tier fragments).
        `get(keys, gpu, skip=len(keys))` stages lower-tier blocks into the
        CPU tier without copying anything to the GPU. With `hit=False` (such
        a staging pass ahead of the GET itself) the CPU prefix is not touched
        and no selective write-down is planned: one engine load is one hit.
        Blocks staged or written down join namespace `ns`. Staged blocks
        become ready together, or, cut at the block counts `ready_at`, each
        part once it and every part before it have landed (a load asked for
        in parts: each is answered as soon as its blocks are ready). With
        `end` (and `stage=False`: one part of a load in parts), only
        keys[skip:end] are copied and counted, but the CPU prefix is matched
        and locked whole, so the staged blocks of the parts after it stay
        in the tier until those are asked for.
        """
        n = _check_request(keys, gpu_blocks)
        if not 0 <= skip <= n:
            raise ValueError(f"skip must be in [0, {n}], got {skip}")
        if end is not None and (stage or not skip <= end <= n):
            raise ValueError(f"end must be in [{skip}, {n}] and stage False, got {end}")
        if self._ttls:
            self.expire()
        run, graph = self._start(PlanKind.GET)
        cpu_m = self.cpu.match(keys, touch=hit)
        c = cpu_m.num_blocks
        run.lock(self.cpu, cpu_m.node)
        copied = c if end is None else min(c, end)
        if skip < copied:
            graph.add(OpKind.H2D, cpu_m.slots[skip:copied], gpu_blocks[skip:copied])
        counts = {"cpu": max(0, copied - skip)}
        if stage and cpu_m.num_present == c:  # nothing after the CPU prefix is in flight
            staged = self._stage_from_lower(run, graph, keys, gpu_blocks, cpu_m, skip, ns, ready_at)
            counts.update(staged)
        selective = self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        if hit and selective and cpu_m.node is not None:
            hot = self._hot_prefix(cpu_m.node, c)
            self._write_down(run, graph, keys[:hot], cpu_m.slots[:hot], None, 0, ns)
        hits = TierCounts(counts["cpu"], counts.get("ssd", 0), counts.get("remote", 0))
        return self._launch(run, graph, hit_blocks=hits)

    def _stage_from_lower(
        self,
        run: RunningPlan,
        graph: TransferGraph,
        keys: BlockKeys,
        gpu_blocks: GpuBlockIds,
        cpu_m: MatchResult,
        skip: int,
        ns: int,
        ready_at: Sequence[int],
    ) -> dict[str, int]:
        """Fragments 2 and 3: lower-tier blocks past the CPU prefix, staged
        through one new CPU node that becomes ready when every load landed;
        cut at `ready_at`, its front becomes ready part by part (one load op
        a part and tier, each part's wait on its own and earlier parts' ops)."""
        c = cpu_m.num_blocks
        frags: list[tuple[str, MatchResult, int, int]] = []
        end = c
        for name, tier in self._online():
            m = tier.match(keys)
            if name == "remote" and not self.remote_rule.allows(len(keys) - end, len(keys)):
                continue
            if m.num_blocks > end:
                frags.append((name, m, end, m.num_blocks))
                end = m.num_blocks
        if not frags:
            return {}
        # Lock the sources first: the CPU allocation may evict, and under
        # write-back that writes to the lower tiers, which may evict in turn.
        for name, m, _, _ in frags:
            run.lock(self.lower[name], m.node)
        slots = self.cpu.allocate(end - c, ns)  # the CPU prefix is locked by now
        end = c + slots.size
        if slots.size == 0:
            return {}
        node = self.cpu.insert(BlockKeys(keys[:end]), slots, ns=ns).node
        assert node is not None
        run.inserted.append((self.cpu, node))
        run.lock(self.cpu, node)
        cuts = [b for b in sorted(set(ready_at)) if c < b < end]
        waits = [ReadyWait(self.cpu, node, set(), end - b) for b in cuts]
        wait = ReadyWait(self.cpu, node, set())  # the whole node
        run.waits += [*waits, wait]
        counts: dict[str, int] = {}
        for name, m, start, stop in frags:
            stop = min(stop, end)
            if start >= stop:
                break
            self.lower[name].index.touch(m.node)
            counts[name] = max(0, stop - max(start, skip))
            bounds = [start, *(b for b in cuts if start < b < stop), stop]
            for lo, hi in itertools.pairwise(bounds):
                load = graph.add(_LOAD_OP[name], m.slots[lo:hi], slots[lo - c : hi - c])
                for cut, part in zip(cuts, waits, strict=True):
                    if hi <= cut:
                        part.ops.add(load)
                wait.ops.add(load)
                first = max(lo, skip)
                if first < hi:
                    graph.add(OpKind.H2D, slots[first - c : hi - c], gpu_blocks[first:hi], (load,))
        return counts

    def _hot_prefix(self, node: RadixNode, matched: int) -> int:
        """Blocks of the matched CPU prefix whose nodes have enough hits.

        Hit counts never grow down a path (a hit on a node is a hit on its
        ancestors), so the hot blocks are a prefix: find its deepest node.
        """
        if node.hit_count >= self.write_through_min_hits:
            return matched
        end = _depth_above(node)
        cur = node.parent
        while cur is not None and cur.parent is not None:
            if cur.hit_count >= self.write_through_min_hits:
                return end
            end -= len(cur)
            cur = cur.parent
        return 0

    # ---- PUT ---------------------------------------------------------------------

    def put(self, keys: BlockKeys, gpu_blocks: GpuBlockIds, ns: int = 0, skip: int = 0) -> Plan:
        """Plan saving keys (from gpu_blocks) to the CPU tier and, per the
        write policy, below it, as blocks of namespace `ns`. Blocks another
        plan is already saving are left to it. The first `skip` blocks are a
        prefix the engine has no bytes for (gpu_blocks[:skip] are never
        read): nothing is stored unless that prefix is ready in the CPU tier."""
        n = _check_request(keys, gpu_blocks)
        if not 0 <= skip <= n:
            raise ValueError(f"skip must be in [0, {n}], got {skip}")
        if self._ttls:
            self.expire()
        run, graph = self._start(PlanKind.PUT)
        m = self.cpu.match(keys)
        c = m.num_blocks
        run.lock(self.cpu, m.node)
        cpu_slots: np.ndarray = m.slots
        d2h = None
        stored = 0
        if m.num_present == c and skip <= c < n:
            slots = self.cpu.allocate(n - c, ns)
            stored = slots.size
            if stored:
                node = self.cpu.insert(BlockKeys(keys[: c + stored]), slots, ns=ns).node
                assert node is not None
                run.inserted.append((self.cpu, node))
                run.lock(self.cpu, node)
                d2h = graph.add(OpKind.D2H, gpu_blocks[c : c + stored], slots)
                run.waits.append(ReadyWait(self.cpu, node, {d2h}))
                cpu_slots = np.concatenate([m.slots, slots])
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_down(run, graph, keys[: c + stored], cpu_slots, d2h, c, ns)
        in_flight = m.num_present - c
        return self._launch(
            run, graph, skipped_blocks=c, stored_blocks=stored, in_flight_blocks=in_flight
        )

    def _write_down(
        self,
        run: RunningPlan,
        graph: TransferGraph,
        keys: np.ndarray,
        cpu_slots: np.ndarray,
        after: int | None,
        after_from: int,
        ns: int,
    ) -> None:
        """Copy the blocks of `keys` each lower tier lacks from `cpu_slots`.

        The CPU blocks must be locked by `run`. Blocks at or past `after_from`
        are still landing by op `after`, so their writes depend on it.
        """
        n = len(keys)
        for name, tier in self._online():
            m = tier.match(BlockKeys(keys))
            t = m.num_blocks
            if t >= n or m.num_present > t:
                continue
            want = n - t
            if name == "remote" and self.quota is not None:
                want = self.quota.admit(want)
                if not want:
                    continue
            run.lock(tier, m.node)
            slots = tier.allocate(want, ns)
            if slots.size == 0:
                continue
            end = t + slots.size
            node = tier.insert(BlockKeys(keys[:end]), slots, ns=ns).node
            assert node is not None
            run.inserted.append((tier, node))
            deps = (after,) if after is not None and end > after_from else ()
            op = graph.add(_STORE_OP[name], cpu_slots[t:end], slots, deps)
            run.waits.append(ReadyWait(tier, node, {op}))
            if name == "remote" and self.quota is not None:
                self.quota.hold(run.plan.plan_id, op, int(slots.size))

    def write_down_ready(self, keys: BlockKeys, ns: int = 0) -> None:
        """Blocks of `keys` made ready in the CPU tier outside a plan (an
        engine's commit of granted slots): under write_through, write what
        the lower tiers lack in a background plan, as a PUT would have.
        Under the other policies their writes come later as for any block
        (on hits, or on eviction)."""
        if self.write_policy is not WritePolicy.WRITE_THROUGH or not self.lower:
            return
        m = self.cpu.match(keys)
        self._write_in_background(keys[: m.num_blocks], m.slots, m.node, ns, hold=None)

    # ---- write-back ------------------------------------------------------------

    def _write_back(self, evicted: EvictedRun) -> np.ndarray:
        """CPU eviction hook, once per evicted run: write the blocks the lower
        tiers lack in a background plan. Returns the run's CPU slots, kept
        until the write lands (empty when nothing needed writing). The plan
        locks the run's parent, whose blocks the write may read too, so the
        same eviction cannot take it next."""
        parent = evicted.parent
        above_keys, above_slots = self.cpu.index.path(parent)
        keys = np.concatenate([above_keys, np.frombuffer(evicted.key_bytes, dtype=KEY_DTYPE)])
        slots = np.concatenate([above_slots, evicted.slots])
        lock = parent if parent.parent is not None else None
        wrote = self._write_in_background(keys, slots, lock, evicted.ns, hold=evicted.slots)
        return evicted.slots if wrote else evicted.slots[:0]

    def _write_in_background(
        self,
        keys: np.ndarray,
        slots: np.ndarray,
        lock: RadixNode | None,
        ns: int,
        hold: np.ndarray | None,
    ) -> bool:
        """A background plan writing the blocks (CPU `slots`) the lower tiers
        lack, with CPU node `lock` locked (None: nothing) and the CPU slots
        `hold` kept until it lands; whether it wrote anything."""
        run, graph = self._start(PlanKind.WRITE_BACK)
        run.lock(self.cpu, lock)
        self._write_down(run, graph, keys, slots, None, 0, ns)
        if graph.ops and hold is not None and hold.size:
            run.held.append((self.cpu, hold))
        plan = self._launch(run, graph)
        if graph.ops:
            self._background.append(plan)
        return bool(graph.ops)

    # ---- delete ----------------------------------------------------------------

    def delete(self, keys: BlockKeys) -> int:
        """Drop block keys[-1] and every block below it from every tier that
        holds all of `keys`; returns the blocks dropped. Raises IndexConflict
        and changes nothing if any of them is locked or in flight (being
        saved or written back: a delete must not report success and then
        see them land)."""
        _check_request(keys, np.zeros(len(keys), dtype=np.int64))
        if len(keys) == 0:
            return 0
        holding = []
        for tier in (self.cpu, *self.lower.values()):
            m = tier.match(keys)
            if m.num_blocks == len(keys):
                holding.append(tier)
            elif m.num_present == len(keys):
                raise IndexConflict("the blocks are being written")
        for tier in holding:
            tier.index.check_removable(keys)
        return sum(tier.remove(keys) for tier in holding)

    # ---- namespaces ---------------------------------------------------------------

    def set_quota(self, tier: str, ns: int, max_blocks: int | None) -> None:
        """Hold namespace `ns` to `max_blocks` blocks in `tier` (None: no quota)."""
        self._tiers([tier])[tier].set_quota(ns, max_blocks)

    def set_ttl(self, ns: int, seconds: float | None) -> None:
        """Serve and keep namespace `ns`'s blocks, in every tier, at most
        `seconds` after they were stored there (None: no limit)."""
        for tier in self._tiers(None).values():
            tier.index.set_ttl(ns, seconds)
        if seconds is None:
            self._ttls.pop(ns, None)
        else:
            self._ttls[ns] = seconds

    def expire(self) -> dict[str, int]:
        """Drop the expired trees nothing holds, in every tier; blocks dropped per tier."""
        return {name: tier.expire() for name, tier in self._tiers(None).items()}

    def clear_namespace(
        self, ns: int, tiers: list[str] | None = None
    ) -> dict[str, tuple[int, int]]:
        """Drop namespace `ns`'s blocks from `tiers` (None: all, offline ones
        too); per tier (blocks dropped, blocks kept: locked or in flight).
        The remote tier forgets the blocks; deleting them from the store is
        its remove_hook's business."""
        return {name: tier.clear_namespace(ns) for name, tier in self._tiers(tiers).items()}

    def clear(self, tiers: list[str] | None = None) -> dict[str, tuple[int, int]]:
        """Drop every ready, unlocked block from `tiers` (None: all); per tier
        (blocks dropped, blocks kept)."""
        return {name: tier.clear() for name, tier in self._tiers(tiers).items()}

    def namespace_usage(self) -> dict[str, dict[int, int]]:
        """Blocks per namespace in each tier (namespaces holding none left out)."""
        return {name: tier.index.namespace_blocks() for name, tier in self._tiers(None).items()}

    def _tiers(self, names: list[str] | None) -> dict[str, CacheEngine]:
        every = {"cpu": self.cpu, **self.lower}
        if names is None:
            return every
        unknown = [n for n in names if n not in every]
        if unknown:
            raise ValueError(f"no tier {unknown[0]!r}; tiers: {', '.join(every)}")
        return {n: every[n] for n in names}

    def _online(self) -> list[tuple[str, CacheEngine]]:
        return [(n, t) for n, t in self.lower.items() if n not in self.offline]


def _depth_above(node: RadixNode) -> int:
    depth = 0
    cur = node.parent
    while cur is not None and cur.parent is not None:
        depth += len(cur)
        cur = cur.parent
    return depth


def _check_request(keys: BlockKeys, gpu_blocks: np.ndarray) -> int:
    if not isinstance(keys, np.ndarray) or keys.dtype != KEY_DTYPE or keys.ndim != 1:
        raise TypeError(f"keys must be a 1-D numpy array of dtype {KEY_DTYPE}")
    gpu = np.asarray(gpu_blocks)
    if gpu.ndim != 1 or gpu.dtype.kind not in "iu":
        raise TypeError(f"gpu_blocks must be a 1-D integer array, got {gpu.dtype} {gpu.shape}")
    if gpu.size != keys.size:
        raise ValueError(f"{keys.size} keys but {gpu.size} gpu blocks")
    if gpu.size and gpu.min() < 0:
        raise ValueError("gpu block ids must be >= 0")
    return int(keys.size)
