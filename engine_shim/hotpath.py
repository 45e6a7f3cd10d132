"""The engine's side of the hot index: lookups and CPU-hit loads without a
round trip (the sidecar's side: sidecar/server/hotpath.py; the table:
shm/hotindex.py).

- A lookup hashes the prompt a chunk at a time (2 blocks, then 16, 128, ...:
  each chunk's parent is the last key of the one before) and probes each
  chunk in the mapped table, stopping at the first block that is not ready
  in the CPU tier: a prompt whose first block misses costs one short hash
  and one probe, whatever its length.
- A load finds each block's (slot, generation), copies the slots into the
  engine's blocks, then checks the generations again: the blocks from the
  first whose slot was vacated meanwhile on are a miss (a partial load),
  and no byte of another block is ever used as this one's.
- What they did reaches the sidecar in batches, never awaited (`Touch`):
  lookups for its hit ratios, loaded prefixes for the eviction policy's
  recency.

A table is trusted only while it is open and its writer stamped it within
the client's timeout: a stopped or killed sidecar's table serves nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from contract import protocol as p
from contract.blocks import KeyHasher
from contract.ids import KEY_BYTES, key_bytes
from cuda_ext.copier import BlockCopier
from shm import hotindex
from shm.hotindex import HotIndexView
from shm.layout import BlockLayout

FIRST_CHUNK = 2
"""Blocks hashed before the first probe; each later chunk is 8x the last."""
TOUCH_BATCH = 256
"""Lookups or loads kept before a Touch goes, at the latest."""
GRANT_LOW = 32
"""Fewer granted slots than this: ask for more (unawaited)."""
GRANT_WANT = 64
"""Slots one Grant asks for."""
TOUCH_SECONDS = 0.05
"""A Touch goes with the next call once its oldest entry is this old."""


class HotPath:
    """One mapped hot index, and the batch of what was done through it."""

    def __init__(self, name: str) -> None:
        """Raises ShmPoolError (gone) or ValueError (not a table)."""
        self.view = HotIndexView(name)
        self.name = name
        self._lookups: list[int] = []
        """(blocks asked, CPU hit blocks) per lookup, flat."""
        self._loads: list[bytes] = []
        self._since = 0.0
        self._lock = threading.Lock()
        """The batch is taken by the heartbeat's thread too."""
        self.granted: list[int] = []
        """CPU slots the sidecar granted this rank for its saves, unused."""
        self.grant_request: int | None = None
        """The id of a Grant request whose reply has not been read yet."""

    def flags(self, max_age: float) -> int:
        """The table's flags while it can be trusted (open, and stamped within
        `max_age` seconds), else 0."""
        state = self.view.state()
        if not state.flags & hotindex.OPEN or state.age > max_age:
            return 0
        return state.flags

    def count(self, hasher: KeyHasher, tokens: np.ndarray) -> tuple[int, int]:
        """(leading blocks ready in the CPU tier, full blocks of `tokens`),
        hashing no further than the first block that is not."""
        tpb = hasher.tokens_per_block
        total = tokens.size // tpb
        done, chunk, parent = 0, FIRST_CHUNK, None
        while done < total:
            n = min(chunk, total - done)
            kb = key_bytes(hasher.hash_tokens(tokens[done * tpb : (done + n) * tpb], parent))
            found = self.view.count(kb)
            done += found
            if found < n:
                break
            parent, chunk = kb[-KEY_BYTES:], chunk * 8
        return done, total

    def load(
        self,
        copier: BlockCopier,
        layout: BlockLayout,
        keys: bytes,
        blocks: np.ndarray,
        skip: int,
        lower_tiers: bool,
    ) -> int | None:
        """Copy the CPU hits of `keys` past the first `skip` into engine
        blocks `blocks[skip:]` straight from the pool, checked by generation;
        the blocks loaded (past `skip`). None if the sidecar must plan it: TP
        (every rank copies its shard of one plan), or a CPU miss where a
        lower tier may hold the block."""
        if layout.tp_size != 1:
            return None
        kb = keys[skip * KEY_BYTES :]
        slots, gens = self.view.find(kb)
        found = len(slots)
        if found < len(kb) // KEY_BYTES and lower_tiers:
            return None
        if found:
            copier.load(blocks[skip : skip + found], slots, layout, 0).synchronize()
            found = self.view.check(slots, gens)  # from a vacated slot on: a miss
        if found:
            self.note_load(kb[: found * KEY_BYTES])
        return found

    def note_lookup(self, asked: int, hit: int) -> None:
        with self._lock:
            if not self._lookups and not self._loads:
                self._since = time.monotonic()
            self._lookups += (asked, hit)

    def note_load(self, keys: bytes) -> None:
        with self._lock:
            if not self._lookups and not self._loads:
                self._since = time.monotonic()
            self._loads.append(keys)

    def due(self) -> bool:
        """Whether the batch should go now."""
        pending = len(self._lookups) // 2 + len(self._loads)
        return pending >= TOUCH_BATCH or (
            pending > 0 and time.monotonic() - self._since >= TOUCH_SECONDS
        )

    def take_touch(self, session: str) -> tuple[Any, list[bytes]] | None:
        """The batch as a Touch request and its frames (None: nothing to
        send); the batch starts again empty."""
        with self._lock:
            if not self._lookups and not self._loads:
                return None
            lookups, loads = self._lookups, self._loads
            self._lookups, self._loads = [], []
        request = p.Touch(
            v=p.PROTOCOL_VERSION,
            id=0,
            session=session,
            load_blocks=[len(k) // KEY_BYTES for k in loads],
        )
        return request, [np.asarray(lookups, dtype=p.ID_DTYPE).tobytes(), b"".join(loads)]

    def close(self) -> None:
        self.view.close()
