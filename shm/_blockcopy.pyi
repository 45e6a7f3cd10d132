"""Types of the C block copy (_blockcopy.c); see shm.copy."""

from typing import Any

import numpy as np

_Addresses = np.ndarray[Any, np.dtype[np.uint64]]

def copy(
    src: _Addresses, dst: _Addresses, nbytes: int, threads: int = 1, stream: bool = False
) -> None: ...
def copy_blocks(
    starts: _Addresses,
    strides: _Addresses,
    slot_offsets: _Addresses,
    ids: _Addresses,
    slots: _Addresses,
    nbytes: int,
    save: bool,
    band: int,
    threads: int = 1,
    stream: bool = False,
) -> None: ...
