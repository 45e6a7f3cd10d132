"""Types of the C blake2b chain (_blake2chain.c); see contract.blocks."""

from typing import Any

import numpy as np
from typing_extensions import Buffer

# Both take any buffer ("y*"). numpy's stubs declare ndarray.__buffer__ only on
# Python >= 3.12, so an ndarray is named here too.
def chain(data: Buffer, block_bytes: int, key: Buffer, parent: Buffer, /) -> bytes: ...
def chain_tokens(
    tokens: Buffer | np.ndarray[Any, Any],
    itemsize: int,
    tokens_per_block: int,
    key: Buffer,
    parent: Buffer,
    /,
) -> bytes: ...
