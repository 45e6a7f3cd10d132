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
from contract.ids import BlockKeys
from contract.protocol import ErrorCode, ProtocolError
from shm import hotindex
from shm.hotindex import HotIndex
from shm.layout import BlockLayout
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


def parse_touch(req: p.Touch, arrays: list[bytes]) -> tuple[list[tuple[int, int]], list[BlockKeys]]:
    """A Touch's lookups ((blocks asked, CPU hit blocks) each) and loads
    (their keys); ProtocolError for a malformed one."""
    pairs, keys = arrays
    if len(pairs) % 16:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "lookups frame is not int64 pairs")
    counts = np.frombuffer(pairs, dtype=p.ID_DTYPE).reshape(-1, 2)
    asked, hit = counts[:, 0], counts[:, 1]
    if ((hit < 0) | (hit > asked) | (asked > p.MAX_BLOCKS_PER_REQUEST)).any():
        raise ProtocolError(ErrorCode.BAD_VALUE, "a lookup's hits must be in [0, blocks asked]")
    all_keys = p.parse_keys(keys)
    sizes = req.load_blocks
    if any(n <= 0 for n in sizes) or sum(sizes) != len(all_keys):
        raise ProtocolError(ErrorCode.BAD_VALUE, "load_blocks must be positive and sum to the keys")
    bounds = np.cumsum([0, *sizes]).tolist()
    loads = [BlockKeys(all_keys[a:b]) for a, b in itertools.pairwise(bounds)]
    return list(zip(asked.tolist(), hit.tolist(), strict=True)), loads
