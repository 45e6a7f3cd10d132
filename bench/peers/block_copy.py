"""The C block copy every system's rows use (`shm._blockcopy`, kvsidecar's
own), over address arrays: so the peers' rows differ from kvsidecar's only
in what each does around the copy. Needs numpy and the built extension
(the project's root on sys.path)."""

from __future__ import annotations

import numpy as np

from shm import _blockcopy
from shm.copy import MAX_THREADS, copy_settings


def copy_ranges(src: np.ndarray, dst: np.ndarray, size: int, *, save: bool) -> None:
    """Copy `size` bytes from each address src[i] to dst[i] (uint64 arrays),
    with the threads and streaming stores kvsidecar's copy picks for the
    batch: `save`, engine -> cache; else cache -> engine."""
    threads, stream = copy_settings(src.size * size, MAX_THREADS, save=save)
    _blockcopy.copy(src.ravel(), dst.ravel(), size, threads, stream)


def layer_addresses(layer_ptrs: np.ndarray, blocks: np.ndarray, size: int) -> np.ndarray:
    """[block, layer] addresses of engine blocks in per-layer tensors of
    [num_blocks, ...] (one layer of one block: `size` contiguous bytes)."""
    return blocks.astype(np.uint64)[:, None] * np.uint64(size) + layer_ptrs[None, :]
