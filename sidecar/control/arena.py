"""The CPU tier's arena: one byte budget shared by every block geometry.

The CPU tier is a row of extents (the shm segments, `cpu_extent_size` each).
Each geometry (a block layout: its own slot size, index and policy) owns
whole extents and carves them into slots of its stride: slot `i` of extent
`k` has the same number for every process that knows the stride and the
extent sizes, so engines address slots as before and never learn who owns
what. A geometry's `Mempool` spans every slot of its stride in the arena and
owns those of its extents.

Capacity moves by eviction, one extent at a time, when a geometry lacks
slots (`CacheEngine.grow`):
1. a free extent goes to it;
2. otherwise, if another geometry's next victim (what its own policy would
   evict next) is older than the asker's, that geometry gives up an
   extent: memcached's slab "age balancing", with each geometry's policy
   naming its candidate and the oldest candidate losing. The giver evicts
   its coldest blocks until its other extents have room for what the chosen
   extent still holds, moves those blocks there (a memcpy each, their index
   nodes take the new slots), and the extent changes hands;
3. otherwise the asker evicts its own blocks, as a tier of its own would.

Only ready, unlocked, unheld blocks move; an extent holding anything else (a
block being written or read by a plan, a write-back in flight, an orphaned
save's slots) is not chosen. The bytes are copied by the `move` callback the
owner of the shm mapping gives (the control plane touches no memory).

The SSD tier shares its budget the same way, but moving a block there is a
read and a write of the device on the control loop: an arena without a
`move` callback drops the blocks of the extent it takes instead (the
giver's emptiest extent whose blocks, and the blocks below them, are all
ready and unlocked), so capacity still moves by eviction, of the extent
the giver can spare most cheaply rather than of its coldest blocks. Each
member may name `claim` and `release` callbacks, called as an extent
becomes or stops being its own (the SSD tier reserves and frees the disk
space behind it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from contract.ids import SlotIds
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.mempool import Mempool
from sidecar.control.node import RadixNode

MoveBlocks = Callable[[int, np.ndarray, np.ndarray], None]
"""`move(stride, src, dst)`: copy the bytes of slots `src` to slots `dst` (of
that stride), in order."""
ExtentHook = Callable[[int, int, int], None]
"""`hook(extent, lo, hi)`: extent `extent`, the member's slots lo..hi-1."""

MAX_EVICT_ROUNDS = 4
"""Rounds of eviction a giver gets to make room for an extent's blocks: a
round can fall short when write-backs keep the slots they evict."""


@dataclass(eq=False)
class Member:
    """A geometry's CPU tier in the arena."""

    engine: CacheEngine
    stride: int
    starts: np.ndarray
    """Per extent, its first slot at this stride; one more entry at the end."""
    extents: set[int] = field(default_factory=set)
    claim: ExtentHook | None = None
    release: ExtentHook | None = None

    def slots_of(self, extent: int) -> tuple[int, int]:
        return int(self.starts[extent]), int(self.starts[extent + 1])


class ExtentArena:
    def __init__(self, extent_sizes: Sequence[int], move: MoveBlocks | None) -> None:
        """`move` None: extents change hands by dropping their blocks."""
        if not extent_sizes or min(extent_sizes) <= 0:
            raise ValueError("the arena needs at least one extent, each of positive size")
        self.sizes = np.asarray(extent_sizes, dtype=np.int64)
        self.owner: list[Member | None] = [None] * len(extent_sizes)
        self.members: list[Member] = []
        self._move = move
        self.num_moves = 0
        """Extents that changed hands between geometries."""
        self.moved_blocks = 0
        """Blocks copied to another slot so their extent could change hands."""
        self.dropped_blocks = 0
        """Blocks dropped so their extent could change hands (no `move`)."""

    def space(self, stride: int) -> int:
        """Slots of `stride` the whole arena holds (a geometry's address space)."""
        return int((self.sizes // stride).sum())

    def fits(self, stride: int) -> bool:
        """Whether a slot of `stride` bytes fits every extent (`join` takes it)."""
        return bool((self.sizes // stride).all())

    def join(
        self,
        engine: CacheEngine,
        stride: int,
        counts: np.ndarray | None = None,
        claim: ExtentHook | None = None,
        release: ExtentHook | None = None,
    ) -> Member:
        """Add a geometry's empty tier: its mempool becomes one spanning the
        arena at `stride` (or `counts` slots per extent, when the tier lays
        its slots out otherwise), owning nothing until it needs slots.
        Raises ValueError if a slot fits no extent."""
        counts = self.sizes // stride if counts is None else np.asarray(counts, dtype=np.int64)
        if counts.shape != self.sizes.shape or not counts.all():
            raise ValueError(
                f"a block of {stride} bytes does not fit an extent of {int(self.sizes.min())} bytes"
            )
        if engine.mempool.num_used:
            raise ValueError("only an empty tier can join the arena")
        starts = np.concatenate([[0], np.cumsum(counts)])
        member = Member(engine, stride, starts, claim=claim, release=release)
        engine.mempool = Mempool(int(starts[-1]), owned=False)
        engine.grow = lambda n, steal: self._grow(member, n, steal)
        self.members.append(member)
        return member

    def adopt(self, member: Member, extent: int) -> bool:
        """Give a free extent to the member (a restart putting back what its
        files hold); False if another member owns it."""
        owner = self.owner[extent]
        if owner is not None:
            return owner is member
        self._give(extent, member)
        return True

    def unowned_slots(self, stride: int) -> int:
        """Slots of `stride` in the extents no geometry owns yet."""
        free = [k for k, owner in enumerate(self.owner) if owner is None]
        return int((self.sizes[free] // stride).sum())

    def unowned_slots_for(self, engine: CacheEngine) -> int:
        """Slots a member tier would get from the extents no one owns (at
        its own count per extent)."""
        member = next((m for m in self.members if m.engine is engine), None)
        if member is None:
            return 0
        free = [k for k, owner in enumerate(self.owner) if owner is None]
        return int(np.diff(member.starts)[free].sum())

    def extents_of(self, engine: CacheEngine) -> int:
        """How many extents a member tier owns."""
        return next((len(m.extents) for m in self.members if m.engine is engine), 0)

    def figures(self) -> dict[str, int]:
        return {
            "extents": len(self.owner),
            "free_extents": sum(o is None for o in self.owner),
            "extent_moves": self.num_moves,
            "moved_blocks": self.moved_blocks,
            "dropped_blocks": self.dropped_blocks,
        }

    # ---- growing ------------------------------------------------------------------

    def _grow(self, member: Member, want: int, steal: bool) -> int:
        """Give the member extents until it has `want` free slots: free ones
        first, then (with `steal`) other geometries' with older next victims.
        Returns the slots granted."""
        pool = member.engine.mempool
        granted = 0
        for extent, owner in enumerate(self.owner):
            if pool.num_free >= want:
                return granted
            if owner is None:
                granted += self._give(extent, member)
        while steal and pool.num_free < want:
            stolen = self._steal(member)
            if not stolen:
                break
            granted += stolen
        return granted

    def _steal(self, member: Member) -> int:
        own_age = member.engine.index.next_victim_age()
        givers = []
        for other in self.members:
            if other is member or not other.extents:
                continue
            age = other.engine.index.next_victim_age()
            if age is not None and (own_age is None or age < own_age):
                givers.append((age, id(other), other))
        for _, _, giver in sorted(givers):
            extent = self._shrink(giver)
            if extent is not None:
                self.num_moves += 1
                return self._give(extent, member)
        return 0

    def _give(self, extent: int, member: Member) -> int:
        lo, hi = member.slots_of(extent)
        if member.claim is not None:
            member.claim(extent, lo, hi)
        member.engine.mempool.grant(lo, hi)
        member.extents.add(extent)
        self.owner[extent] = member
        return hi - lo

    def _let_go(self, extent: int, giver: Member) -> None:
        giver.extents.discard(extent)
        self.owner[extent] = None
        if giver.release is not None:
            giver.release(extent, *giver.slots_of(extent))

    def _shrink(self, giver: Member) -> int | None:
        """Empty one of the giver's extents, evicting its coldest blocks and
        moving the rest; the extent, or None if none can be emptied."""
        if self._move is None:
            return self._drop_extent(giver)
        engine, pool = giver.engine, giver.engine.mempool
        for _ in range(MAX_EVICT_ROUNDS + 1):
            where = _slot_owners(engine)
            extent = _emptiest_movable(giver, where)
            if extent is None:
                return None
            lo, hi = giver.slots_of(extent)
            used = pool.num_used_in(lo, hi)
            room = pool.num_free - (hi - lo - used)
            if used <= room:
                break
            before = engine.num_evicted_blocks
            engine.evict(used - room)
            if engine.num_evicted_blocks == before:
                return None
        else:
            return None
        pool.retire_free(lo, hi)
        src = np.flatnonzero(where.node_of[lo:hi] >= 0) + lo
        if src.size:
            dst = pool.allocate(int(src.size))
            self._move(giver.stride, src, dst)
            _renumber(where, src, dst)
            pool.retire(src)
            self.moved_blocks += int(src.size)
        self._let_go(extent, giver)
        return extent

    def _drop_extent(self, giver: Member) -> int | None:
        """Empty the giver's emptiest extent whose blocks can all go (they and
        the blocks below them ready and unlocked) by dropping them; the
        extent, or None if none can be emptied."""
        engine, pool = giver.engine, giver.engine.mempool
        where = _slot_owners(engine)
        by_use = sorted(giver.extents, key=lambda k: (pool.num_used_in(*giver.slots_of(k)), k))
        for extent in by_use:
            lo, hi = giver.slots_of(extent)
            if pool.held_in(lo, hi) or not where.movable[lo:hi].all():
                continue
            cuts: dict[int, int] = {}  # node -> its first position in the extent
            for slot in (np.flatnonzero(where.node_of[lo:hi] >= 0) + lo).tolist():
                i, pos = int(where.node_of[slot]), int(where.position[slot])
                cuts[i] = min(cuts.get(i, pos), pos)
            runs = sorted(((_depth(where.nodes[i]), where.nodes[i], p) for i, p in cuts.items()),
                          key=lambda run: run[0])  # fmt: skip
            if not all(engine.index.removable(node) for _, node, _ in runs):
                continue
            gone: set[int] = set()
            for _, node, pos in runs:  # ancestors first: a dropped run takes its subtree
                if id(node) in gone:
                    continue
                gone.update(id(n) for n in engine.index.subtree(node))
                self.dropped_blocks += engine.drop_from(node, pos)
            pool.retire_free(lo, hi)
            self._let_go(extent, giver)
            return extent
        return None


@dataclass
class _SlotOwners:
    """Which index node holds each slot of a tier, and whether it may move."""

    nodes: list[RadixNode]
    node_of: np.ndarray
    """Per slot: index into `nodes`, or -1 (free, or used outside the index)."""
    position: np.ndarray
    """Per slot: its place in its node's run."""
    movable: np.ndarray
    """Per slot: free, or held by a ready, unlocked node."""


def _slot_owners(engine: CacheEngine) -> _SlotOwners:
    pool = engine.mempool
    node_of = np.full(pool.space, -1, dtype=np.int64)
    position = np.zeros(pool.space, dtype=np.int64)
    movable = np.zeros(pool.space, dtype=np.bool_)
    nodes: list[RadixNode] = []
    stack = list(engine.index.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        slots = np.asarray(node.slots, dtype=np.int64)
        node_of[slots] = len(nodes)
        position[slots] = np.arange(slots.size)
        movable[slots] = node.ready and node.lock_count == 0
        nodes.append(node)
    free = pool.free_slots()
    movable[free] = True
    return _SlotOwners(nodes, node_of, position, movable)


def _emptiest_movable(member: Member, where: _SlotOwners) -> int | None:
    """The member's extent with the fewest used slots, all of them movable."""
    pool = member.engine.mempool
    best, best_used = None, None
    for extent in sorted(member.extents):
        lo, hi = member.slots_of(extent)
        if pool.held_in(lo, hi) or not where.movable[lo:hi].all():
            continue
        used = pool.num_used_in(lo, hi)
        if best_used is None or used < best_used:
            best, best_used = extent, used
    return best


def _depth(node: RadixNode) -> int:
    depth = 0
    while node.parent is not None:
        node, depth = node.parent, depth + 1
    return depth


def _renumber(where: _SlotOwners, src: np.ndarray, dst: np.ndarray) -> None:
    """The nodes holding slots `src` hold `dst` instead (a new array each)."""
    by_node: dict[int, list[tuple[int, int]]] = {}
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        by_node.setdefault(int(where.node_of[s]), []).append((int(where.position[s]), d))
    for i, moves in by_node.items():
        node = where.nodes[i]
        slots = np.array(node.slots, dtype=np.int64)
        for pos, d in moves:
            slots[pos] = d
        node.slots = SlotIds(slots)
