"""The floor of `bench control`'s per-call rows: the same bytes copied
between two page-aligned, pre-faulted buffers by the same C copy, nothing
else (see bench/peers/calls.py for the protocol).

A save of n blocks copies n x block bytes from the "engine" buffer into the
"cache" buffer, block by block; a load copies them back. The floor has no
lookup: its spec lists no lookup prompts.
"""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np

from bench.peers.block_copy import copy_ranges
from bench.peers.calls import block_bytes, worker_main


class Floor:
    """What every memcpy floor does besides copying: nothing."""

    own_buffers = True
    """Whether it copies between buffers of its own (bench/peers/calls.py,
    PairedFloor: those must fit beside the system's)."""

    def forget(self, tokens: np.ndarray) -> None:
        pass

    def lookup(self, tokens: np.ndarray) -> int:
        raise RuntimeError("the memcpy floor has no lookup")

    def prepare_load(self, tokens: np.ndarray) -> None:
        pass

    def tidy(self) -> None:
        pass


class MemcpyFloor(Floor):
    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._bases: list[int] = []
        self._block = 0
        self._tpb = 1

    def open(self, geometry: dict[str, Any], kv_blocks: int, cache_blocks: int) -> None:
        self._block, self._tpb = block_bytes(geometry), geometry["tokens_per_block"]
        size = kv_blocks * self._block
        for _ in range(2):  # mmap: page-aligned; filled once, so every page is faulted in
            m = mmap.mmap(-1, size)
            view = np.frombuffer(m, dtype=np.uint8)
            view[:] = 1
            self._bases.append(view.ctypes.data)
            del view
            self._maps.append(m)

    def _copy(self, n: int, src: int, dst: int, save: bool) -> int:
        offsets = np.arange(n, dtype=np.uint64) * np.uint64(self._block)
        copy_ranges(offsets + np.uint64(src), offsets + np.uint64(dst), self._block, save=save)
        return n * self._tpb

    def save(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        return self._copy(len(block_ids), self._bases[0], self._bases[1], save=True)

    def load(self, tokens: np.ndarray, block_ids: np.ndarray) -> int:
        return self._copy(len(block_ids), self._bases[1], self._bases[0], save=False)

    def close(self) -> None:
        self._bases.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()


if __name__ == "__main__":
    sys.exit(worker_main(lambda _: MemcpyFloor(), "numpy " + np.__version__, "memcpy"))
