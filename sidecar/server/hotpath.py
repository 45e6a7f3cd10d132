"""What the sidecar publishes so engines skip the round trip: a hot index
per block geometry (shm/hotindex.py), kept true by hooks on the CPU tier.

- `RadixIndex.on_ready`: blocks that become ready are published (key ->
  slot, generation);
- `Mempool.on_vacate`: a slot freed or retired gets a new generation and
  loses its entry, before the mempool can hand it out again;
- an arena move (`ExtentArena`, blocks copied to another extent so theirs
  can change hands) moves the entries with the blocks.

Everything runs on the loop's thread, the index's only writer. The loop
stamps every index each round (`stamp`): an engine trusts a table only
while its stamp is fresh, so one of a killed sidecar stops serving hits
within the engine's timeout, as its lookups would have.
"""

from __future__ import annotations

import itertools

import numpy as np

from contract import protocol as p
from contract.ids import BlockKeys, SlotIds
from contract.protocol import ErrorCode, ProtocolError
from shm import hotindex
from shm.hotindex import HotIndex
from shm.layout import BlockLayout
from sidecar.control.cache_engine import CacheEngine
from sidecar.control.planner import GlobalCacheEngine
from sidecar.server.sessions import Session
from sidecar.tiers.tiered import TieredCache


class HotIndexes:
    """The hot index of every geometry (by slot stride); none at all
    without the C extension (engines then use the protocol for everything)."""

    def __init__(self, shm_prefix: str, mode: int, gid: int | None, write_policy: str) -> None:
        self._prefix = shm_prefix
        self._mode = mode
        self._gid = gid
        self._write_policy = write_policy
        self._by_layout: dict[BlockLayout, HotIndex] = {}

    def add(self, realm: TieredCache, layout: BlockLayout, num_slots: int) -> None:
        """Publish `realm`'s CPU tier (a new geometry, empty so far)."""
        if not hotindex.AVAILABLE:
            return
        cache = realm.cache
        flags = hotindex.OPEN
        if cache.lower:
            flags |= hotindex.LOWER_TIERS
        # A selective write-through counts the CPU hits of loads on the
        # sidecar (docs/control-plane.md, "Plans"): those loads go there.
        if not (cache.lower and self._write_policy == "write_through_selective"):
            flags |= hotindex.LOADS
        flags |= hotindex.SAVES  # a commit plans the writes down (write_down_ready)
        if cache.cpu.observes:  # `auto` learns from every lookup's whole chain
            flags |= hotindex.OBSERVED
        name = hotindex.index_name(self._prefix, len(self._by_layout))
        index = HotIndex(name, num_slots, flags, mode=self._mode, gid=self._gid)
        self._by_layout[layout] = index
        cpu = cache.cpu
        cpu.index.on_ready = lambda keys, slots: index.publish(keys, slots)
        cpu.mempool.on_vacate = index.vacate

    def name_of(self, layout: BlockLayout) -> str:
        """The segment engines of this geometry map ("" if none)."""
        index = self._by_layout.get(layout)
        return "" if index is None else index.name

    def move(self, stride: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Blocks moved between slots of `stride`. Geometries of one stride
        share slot numbers, but a slot's bytes lie in one extent with one
        owner: only its table has entries for `src`, the others ignore it."""
        for layout, index in self._by_layout.items():
            if layout.slot_stride == stride:
                index.move(src, dst)

    def stamp(self) -> None:
        for index in self._by_layout.values():
            index.stamp()

    def close(self) -> None:
        """Mark every table closed and unlink it (idempotent)."""
        for index in self._by_layout.values():
            index.close()


def parse_touch(
    req: p.Touch, arrays: list[bytes]
) -> tuple[list[tuple[int, int]], list[tuple[BlockKeys, int]], list[BlockKeys]]:
    """A Touch's lookups ((blocks asked, CPU hit blocks) each), loads (their
    prefix's keys, and how many of them were skipped) and observed lookups
    (their chains); ProtocolError for a malformed one."""
    pairs, keys, seen = arrays
    if len(pairs) % 16:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "lookups frame is not int64 pairs")
    counts = np.frombuffer(pairs, dtype=p.ID_DTYPE).reshape(-1, 2)
    asked, hit = counts[:, 0], counts[:, 1]
    if ((hit < 0) | (hit > asked) | (asked > p.MAX_BLOCKS_PER_REQUEST)).any():
        raise ProtocolError(ErrorCode.BAD_VALUE, "a lookup's hits must be in [0, blocks asked]")
    loads = _split_keys(keys, req.load_blocks, "load_blocks")
    skips = req.load_skip or [0] * len(loads)
    if len(skips) != len(loads) or any(
        not 0 <= n < len(k) for n, k in zip(skips, loads, strict=True)
    ):
        raise ProtocolError(ErrorCode.BAD_VALUE, "load_skip must be one per load, below its blocks")
    chains = _split_keys(seen, req.seen_blocks, "seen_blocks")
    if any(len(c) > p.MAX_BLOCKS_PER_REQUEST for c in chains):
        raise ProtocolError(ErrorCode.BAD_VALUE, "an observed lookup is longer than a request")
    pairs_out = list(zip(asked.tolist(), hit.tolist(), strict=True))
    return pairs_out, list(zip(loads, skips, strict=True)), chains


def _split_keys(frame: bytes, sizes: list[int], field: str) -> list[BlockKeys]:
    all_keys = p.parse_keys(frame)
    if any(n <= 0 for n in sizes) or sum(sizes) != len(all_keys):
        raise ProtocolError(ErrorCode.BAD_VALUE, f"{field} must be positive and sum to the keys")
    bounds = np.cumsum([0, *sizes]).tolist()
    return [BlockKeys(all_keys[a:b]) for a, b in itertools.pairwise(bounds)]


MAX_GRANT = 256
"""Slots one rank may hold granted at once..."""
GRANT_SHARE = 16
"""... and at most this fraction of its geometry's slots in the CPU tier: a
grant is cache capacity set aside (a tier of 32 slots grants 2, one of 15
none, so its engines save through plans)..."""
GRANT_EVICT_SHARE = 64
"""... and of a full tier (slots that must be evicted for) a smaller one: a
slot granted ahead is a block evicted ahead, which under a policy with a
small probationary queue (S3-FIFO's) costs hits. Through a running sidecar
(`bench replay --live`, the Mooncake trace at 1% of its blocks) the 1/16
share cost s3fifo 0.9 points against replay, 1/64 0.1..."""
GRANT_EVICT_MIN = 16
"""... but never fewer than this many (within the first share): a tier of
up to 1,024 slots grants as before, so its saves of a few blocks still go
through grants."""


def grant(session: Session, cpu: CacheEngine, want: int) -> np.ndarray:
    """Up to `want` free CPU slots for the rank's next saves (fewer when the
    tier cannot free more, or the rank holds MAX_GRANT); ProtocolError for a
    bad `want`."""
    if not 1 <= want <= MAX_GRANT:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"want must be in [1, {MAX_GRANT}]")
    space, held = cpu.mempool.space, len(session.granted)
    cap = min(MAX_GRANT, space // GRANT_SHARE)
    n = min(want, cap - held)
    free = cpu.mempool.num_free
    if n > free:  # the rest would be evicted for
        evicting_cap = min(cap, max(space // GRANT_EVICT_SHARE, GRANT_EVICT_MIN))
        n = max(free, min(n, evicting_cap - held))
    # Free slots set aside, not blocks: a namespace's quota is applied when
    # they are committed (allocating under it would evict its blocks for them).
    slots = cpu.allocate(n) if n > 0 else np.empty(0, dtype=np.int64)
    session.granted.update(slots.tolist())
    return np.asarray(slots, dtype=np.int64)


def commit(
    session: Session,
    cache: GlobalCacheEngine,
    keys: BlockKeys,
    slots: np.ndarray,
    first: int,
    ns: int,
) -> tuple[int, int, int]:
    """Make the blocks the rank copied into its granted `slots` (those of
    keys[first:]) ready; (stored, dropped, leading blocks of `keys` ready
    now). A block the tier has (another
    engine stored it since the rank looked) or cannot take (the prefix
    before it is gone, or is being saved by a plan right now) is dropped:
    its slot is free again. Stored blocks are written down to the lower
    tiers as a save's would be (in the background). ProtocolError, nothing
    changed, if a slot is not granted to this rank or repeats."""
    if not 0 <= first <= len(keys) or slots.size != len(keys) - first:
        raise ProtocolError(ErrorCode.BAD_VALUE, "one granted slot per key from `first` on")
    listed = slots.tolist()
    if len(set(listed)) != len(listed) or not session.granted.issuperset(listed):
        raise ProtocolError(ErrorCode.BAD_VALUE, "slots must be granted to this rank, once each")
    session.granted.difference_update(listed)
    cpu = cache.cpu
    match = cpu.match(keys)
    ready = match.num_blocks
    stored = 0
    if match.num_present == ready and first <= ready < len(keys):
        if match.node is not None:  # a quota's evictions must leave the prefix
            cpu.lock(match.node)
        try:
            stored = cpu.room_under_quota(len(keys) - ready, ns)
        finally:
            if match.node is not None:
                cpu.unlock(match.node)
    if stored:
        end = ready + stored
        new = SlotIds(slots[ready - first : end - first])
        cpu.insert(BlockKeys(keys[:end]), new, ready=True, ns=ns)
        cache.write_down_ready(BlockKeys(keys[:end]), ns)
    kept = np.zeros(slots.size, dtype=np.bool_)
    kept[ready - first : ready - first + stored] = True
    dropped = slots[~kept]
    cpu.mempool.free(dropped)
    return stored, int(dropped.size), ready + stored
