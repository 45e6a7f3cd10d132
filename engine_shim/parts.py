"""A load whose blocks the sidecar must stage from SSD or the remote store,
asked for in parts, so that the engine copies one part out of the pool while
the sidecar stages the next. Asked for whole, every copy waited for the last
block to be staged (`bench ssd`'s end-to-end GET of 256 blocks of 256 KiB:
the engine's copy was about 12% of its time).

Each part is a Load of every key with `skip` at the part's first block and
`end` past its last. The first part's request stages the whole load, as
one request would (same double-get rule, same probe), made ready part by
part; each part is answered once its own blocks are ready. `AHEAD` parts
are asked for before the first is answered, one more as each is, so the
sidecar always holds the next. A part answered short (a block missing, or
evicted in between) ends the load there: the parts asked for after it are
given up (a plan in their reply is given back, as for a call that timed
out), and the load counts the blocks of the parts before.

Only for a rank alone (TP ranks share one plan per load) and a load the hot
index could not serve: its CPU prefix ends before the request does, and a
lower tier may hold the rest.
"""

from __future__ import annotations

import collections
import contextlib
import time

import numpy as np

from contract import protocol as p
from contract.ids import BlockKeys
from contract.protocol import ErrorCode
from engine_shim.channel import SidecarError, SidecarUnavailable
from engine_shim.link import SidecarLink, plan_ops
from engine_shim.transfer import TransferHandle

PART_BYTES = 4 << 20
"""At least about this many bytes a part (whole blocks, at least one)..."""
MAX_PARTS = 16
"""... and at most this many parts (each costs a request)."""
AHEAD = 2
"""Parts asked for before the first is answered."""


def part_ends(begin: int, end: int, block_bytes: int) -> list[int]:
    """Where the parts of a load of blocks [begin, end) end."""
    step = max(1, PART_BYTES // block_bytes, -(-(end - begin) // MAX_PARTS))
    return [*range(begin + step, end, step), end]


def worth_parts(num_blocks: int, block_bytes: int) -> bool:
    """Whether a load of `num_blocks` past its skip is worth asking in parts."""
    return num_blocks * block_bytes > PART_BYTES


def load_in_parts(
    link: SidecarLink, keys: BlockKeys, blocks: np.ndarray, skip: int, tokens_per_block: int
) -> TransferHandle | None:
    """Load keys[skip:] into blocks[skip:] in parts (`skip` in blocks); the
    handle waits for every part's copies and acknowledgement. None if the
    sidecar did not know the session (nothing was loaded: ask it as one load,
    which registers again). Raises as one load would if the first part fails;
    a later part that fails ends the load short, at the parts before it.
    The whole load waits at most the client's timeout, as one request would:
    a part not answered by then ends it short too."""
    assert link.layout is not None
    ends = part_ends(skip, len(keys), link.layout.block_bytes)
    channel = link.channel
    asked: collections.deque[tuple[int, int, int]] = collections.deque()
    """(request id, first block, end) of the parts asked for, in order."""

    def ask(i: int) -> None:
        begin, end = (skip if i == 0 else ends[i - 1]), ends[i]
        rid = channel.send(link.req(p.Load, skip=begin, end=end), frames)
        asked.append((rid, begin, end))

    link.ready()
    deadline = time.monotonic() + link.timeout
    frames = [p.keys_frame(keys), p.ids_frame(blocks)]
    parts: list[TransferHandle] = []
    loaded = skip
    try:
        for i in range(min(AHEAD, len(ends))):
            ask(i)
        following = len(asked)
        while asked:
            rid, begin, end = asked.popleft()
            try:  # one timeout for the whole load, as for one request
                reply, arrays = channel.wait_reply(rid, max(deadline - time.monotonic(), 1e-3))
            except (SidecarError, SidecarUnavailable) as err:
                if parts:
                    break  # the load ends at the parts answered
                if isinstance(err, SidecarError) and err.code is ErrorCode.NOT_REGISTERED:
                    return None
                raise
            if following < len(ends) and reply.hit_blocks == end - begin:
                try:
                    ask(following)
                    following += 1
                except SidecarUnavailable:
                    following = len(ends)  # gone: the parts asked for are all there will be
            try:
                parts.append(link.run(plan_ops(reply, arrays, "load"), 0))
            except Exception:
                for part in parts:  # their slots go back once they are reported
                    with contextlib.suppress(Exception):
                        part.wait()
                raise
            loaded = begin + reply.hit_blocks
            if loaded < end:
                break
    finally:
        for rid, _, _ in asked:
            channel.abandon(rid)
    return link.handle(None, loaded * tokens_per_block, None, parts=parts)
