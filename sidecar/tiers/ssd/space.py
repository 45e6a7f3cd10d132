"""The SSD tier's budget, shared by every block geometry the sidecar serves.

Each directory gives the tier `ssd_capacity_per_dir` bytes (less when its
filesystem lacks room), cut into extents of `ssd_extent_size` bytes (one
extent is that many bytes in every directory); a restart asking for the
same keeps the extent size its files were laid out in. Every geometry has an SSD
store of its own, its files named after its layout and sized to the whole
budget but sparse, and a `CacheEngine` that joins one `ExtentArena` over
the extents: a geometry owns whole extents, and the disk behind an extent
is reserved while it is owned. Capacity moves as in the CPU tier's arena
(the geometry whose next victim is oldest gives up an extent), except that
the giver drops the extent's blocks rather than copying them across the
device on the control loop: its emptiest extent that nothing is reading
or writing.

A restart reopens every geometry's files it finds in the first directory
(the header records the layout) before any engine registers, so blocks of
every model are recovered; an extent claimed by two stores' records (a
crash during a hand-over) stays with the first store opened and the other's
records in it are dropped. Files of an older format are removed, with a
warning: they are this instance's own cache.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from contract.ids import KEY_DTYPE, BlockKeys, SlotIds
from shm.layout import BlockLayout
from sidecar.config import Config
from sidecar.control.arena import ExtentArena
from sidecar.control.cache_engine import CacheEngine
from sidecar.tiers.engines import tier_engine
from sidecar.tiers.ssd.store import (
    ALIGN,
    NO_TAG,
    RECORD_BYTES,
    Record,
    SsdError,
    SsdStore,
    read_header,
)

log = logging.getLogger("kvsidecar")

MIN_AUTO_EXTENT, MAX_AUTO_EXTENT = 64 << 20, 4 << 30
AUTO_EXTENTS = 64
"""Without `ssd_extent_size`: the capacity in up to 64 equal extents of at
least 64 MiB, more if one would exceed 4 GiB."""

SsdTier = tuple[CacheEngine, SsdStore]


def extent_bytes(config: Config, per_dir: int) -> int:
    """One extent's bytes in each directory (a whole number of pages)."""
    if config.ssd_extent_size is not None:
        size = min(config.ssd_extent_size, per_dir)
    else:
        count = min(AUTO_EXTENTS, max(1, per_dir // MIN_AUTO_EXTENT))
        count = max(count, -(-per_dir // MAX_AUTO_EXTENT))
        size = per_dir // count
    return max(ALIGN, size // ALIGN * ALIGN)


class SsdSpace:
    """Every geometry's SSD tier, over one budget of extents."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.dirs = [Path(d) for d in config.ssd_dirs]
        self.prefix = f"kvsidecar-{config.instance}"
        self.tiers: dict[BlockLayout, SsdTier | None] = {}
        """Per geometry, its tier (None: the geometry has none)."""
        self._remove_old_format()
        per_dir = min(_room(d, config.ssd_capacity_per_dir, self.prefix) for d in self.dirs)
        self.asked: list[str | int] = (
            ["auto", config.ssd_capacity_per_dir]
            if config.ssd_extent_size is None
            else ["size", config.ssd_extent_size]
        )
        """What the extent size is derived from (besides the room), recorded
        in each header."""
        self.extent_bytes = self._kept_extent(per_dir) or extent_bytes(config, per_dir)
        self.num_extents = per_dir // self.extent_bytes
        self.arena = ExtentArena([self.extent_bytes] * self.num_extents, move=None)
        log.info(
            "SSD tier: %d extent(s) of %d MiB in each of %d dir(s), shared by every geometry",
            self.num_extents,
            self.extent_bytes >> 20,
            len(self.dirs),
        )
        for layout in self._layouts_on_disk():
            self.tiers[layout] = self._open(layout)

    def tier(self, layout: BlockLayout) -> SsdTier | None:
        """The geometry's tier (engine and store), opened on first use; None
        when it cannot have one (logged)."""
        if layout not in self.tiers:
            self.tiers[layout] = self._open(layout)
        return self.tiers[layout]

    def close(self) -> None:
        """Close every store, once no I/O thread uses them (idempotent). The
        records of blocks evicted since their last write are cleared first,
        so that a restart recovers the blocks that were indexed."""
        for tier in self.tiers.values():
            if tier is None:
                continue
            engine, store = tier
            try:
                stale = store.drop_stale(engine.mempool.free_slots())
                log.info("SSD tier: cleared the records of %d evicted blocks", stale)
            except OSError as err:  # they may come back after the restart: no harm
                log.warning("SSD tier: could not clear evicted blocks' records: %s", err)
            store.close()
        self.tiers.clear()

    # ---- opening ------------------------------------------------------------------

    def _open(self, layout: BlockLayout) -> SsdTier | None:
        slot_bytes = layout.slot_stride
        per_extent = self.extent_bytes // slot_bytes
        if per_extent == 0:
            log.warning(
                "SSD tier: a block of %d bytes does not fit an extent of %d bytes "
                "(ssd_extent_size): geometry %s has no SSD tier",
                slot_bytes,
                self.extent_bytes,
                layout,
            )
            return None
        c = self.config
        try:
            store = SsdStore(
                [str(d) for d in self.dirs],
                self.num_extents * per_extent * slot_bytes,
                slot_bytes,
                layout.block_bytes,
                tag=self._tag(layout),
                sparse=True,
                extra=_header_extra(layout, self.extent_bytes, self.asked),
            )
        except (SsdError, ValueError) as err:
            log.error("SSD tier disabled for geometry %s: %s", layout, err)
            return None
        engine = tier_engine("ssd", 0, c)
        stripe = per_extent * len(self.dirs)
        member = self.arena.join(
            engine,
            slot_bytes,
            counts=np.full(self.num_extents, stripe, dtype=np.int64),
            claim=lambda _, lo, hi: store.claim(lo, hi),
            release=lambda _, lo, hi: store.release(lo, hi),
        )
        engine.remove_hook = store.drop_slots
        kept: list[Record] = []
        lost = 0
        for record in store.records():
            if self.arena.adopt(member, record.slot // stripe):
                kept.append(record)
            else:
                store.drop(record.slot)
                lost += 1
        recovered, orphans = recover(engine, kept, store.recovered)
        for slot in orphans:
            store.drop(slot)
        log.info(
            "SSD tier: geometry %s, slots of %d bytes%s; %d blocks recovered, %d orphans "
            "dropped, %d in another geometry's extents dropped",
            layout,
            slot_bytes,
            "" if store.direct else " (buffered: no O_DIRECT)",
            recovered,
            len(orphans),
            lost,
        )
        return engine, store

    def _tag(self, layout: BlockLayout) -> str:
        return f"{self.prefix}-{layout.num_layers}x{layout.layer_block_bytes}x{layout.tp_size}"

    def _kept_extent(self, per_dir: int) -> int | None:
        """The extent size of the files on disk, if it was derived from what
        is asked for now (the same `ssd_extent_size`, or none and the same
        capacity) and one extent still fits: a restart keeps it whatever the
        free space says now. Derived again, it would move with the room,
        which counts our own files: a tier started short of space would
        lose its blocks on every restart."""
        for _, _, extra in self._headers():
            size = extra.get("extent_bytes")
            if (
                extra.get("asked") == self.asked
                and isinstance(size, int)
                and ALIGN <= size <= per_dir
                and size % ALIGN == 0
            ):
                return size
        return None

    def _layouts_on_disk(self) -> list[BlockLayout]:
        """Geometries whose files (of this format and extent size) the first
        directory holds, in name order. Files of this instance laid out in
        other extents are removed (a geometry would start them empty)."""
        found = []
        for stem, layout, extra in self._headers():
            if extra.get("extent_bytes") == self.extent_bytes:
                found.append(layout)
                continue
            log.warning(
                "SSD tier: removing geometry %s's files, laid out in extents of %s bytes",
                layout,
                extra.get("extent_bytes"),
            )
            for d in self.dirs:
                for ext in ("data", "journal", "json"):
                    (d / f"{stem}.{ext}").unlink(missing_ok=True)
        return found

    def _headers(self) -> Iterator[tuple[str, BlockLayout, dict[str, Any]]]:
        """(file stem, geometry, what the header records of the shared
        tier) of each of this instance's geometries in the first directory,
        in name order (another instance's name may start with this one's)."""
        for path in sorted(self.dirs[0].glob(f"{self.prefix}-*.json")):
            header = read_header(path)
            extra = header.get("extra") if header is not None else None
            if not isinstance(extra, dict):
                continue  # not a shared tier's header
            try:
                layout = BlockLayout(*extra["layout"])
            except (KeyError, TypeError, ValueError):
                continue
            if path.stem == self._tag(layout):
                yield path.stem, layout, extra

    def _remove_old_format(self) -> None:
        """The files of a sidecar from before the shared tier (one store
        named after the instance alone)."""
        for d in self.dirs:
            old = [d / f"{self.prefix}.{ext}" for ext in ("data", "journal", "json")]
            if any(p.exists() for p in old):
                log.warning("SSD dir %s: removing this instance's files of an older format", d)
                for p in old:
                    p.unlink(missing_ok=True)


def _header_extra(layout: BlockLayout, extent: int, asked: list[str | int]) -> dict[str, object]:
    return {
        "layout": [layout.num_layers, layout.layer_block_bytes, layout.tp_size],
        "extent_bytes": extent,
        "asked": asked,
    }


def _room(path: Path, want: int, prefix: str) -> int:
    """Bytes of blocks `path` can hold for this instance: `want`, or its
    own files plus 95% of the free space, if less."""
    path.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(path)
    own = re.compile(re.escape(prefix) + r"-\d+x\d+x\d+\.(data|journal|json)")
    ours = sum(
        p.stat().st_blocks * 512 for p in path.iterdir() if own.fullmatch(p.name) and p.is_file()
    )
    # 5% of the free space kept; the journals take up to 64 bytes a 4 KiB slot.
    room = int((ours + st.f_bavail * st.f_frsize * 0.95) * (1 - RECORD_BYTES / ALIGN))
    if room < want:
        log.warning("SSD dir %s has room for %d of the %d bytes asked for", path, room, want)
    return max(0, min(want, room))


def recover(
    engine: CacheEngine, records: list[Record], trees: dict[bytes, dict[bytes, int]] | None = None
) -> tuple[int, list[int]]:
    """Insert every chain the records describe into the engine's index, ready
    (in namespace 0: the namespaces are not known yet).

    A record whose parent key is not itself recorded (and that does not start
    a sequence) is an orphan: unreachable by any prefix match, so its slot is
    returned to be cleared. Returns (blocks recovered, orphan slots). Each
    tree whose top records its namespace goes into `trees[tag][first key]`
    (when the top was written), for that namespace to claim when it
    registers (`SsdStore.recovered`).
    """
    by_key: dict[bytes, Record] = {}
    for r in records:  # a key recorded twice (a crash between writes): keep one
        by_key.setdefault(r.key, r)
    children: dict[bytes, list[Record]] = defaultdict(list)
    roots = []
    for r in by_key.values():
        if r.first:
            roots.append(r)
        elif r.parent in by_key:
            children[r.parent].append(r)
    if trees is not None:
        for r in roots:
            if r.ns_tag != NO_TAG:
                trees.setdefault(r.ns_tag, {})[r.key] = r.written_ms
    runs: list[tuple[bytes, np.ndarray]] = []  # parents before children
    stack: list[tuple[bytes, Record]] = [(b"", r) for r in roots]
    while stack:
        prefix, head = stack.pop()
        run = [head]  # follow single-child links into one run
        while len(children[run[-1].key]) == 1:
            run.append(children[run[-1].key][0])
        keys = prefix + b"".join(r.key for r in run)
        runs.append((keys, np.array([r.slot for r in run], dtype=np.int64)))
        stack += [(keys, child) for child in children[run[-1].key]]
    placed = [int(s) for _, slots in runs for s in slots]
    engine.mempool.take(np.array(placed, dtype=np.int64))  # once: take is O(num_slots)
    for keys, slots in runs:
        engine.insert(BlockKeys(np.frombuffer(keys, dtype=KEY_DTYPE)), SlotIds(slots), ready=True)
    placed_set = set(placed)
    orphans = [r.slot for r in records if r.slot not in placed_set]
    return len(placed), orphans
