"""A dump of the router's index, and the check a dump passes before it is
restored (every key once, after its parent, held by listed workers)."""

from __future__ import annotations

from typing import NamedTuple

from router.keys import BlockKey, Worker


class RouterIndexError(ValueError):
    """An event or dump the index cannot apply; the index is unchanged."""


class DumpEntry(NamedTuple):
    """One key of a dump: its parent (None: from the root) and its holders."""

    key: BlockKey
    parent: BlockKey | None
    workers: tuple[Worker, ...]


class IndexDump(NamedTuple):
    workers: tuple[Worker, ...]
    """Every known worker, those holding nothing included."""
    entries: list[DumpEntry]
    """Parents before children."""


def check_dump(dump: IndexDump) -> None:
    """RouterIndexError unless `dump` is one an index could have produced:
    each key once, after its parent, held by listed workers, and a key held
    by nobody (a hole) continued by some key."""
    listed = set(dump.workers)
    seen: set[BlockKey] = set()
    parents: set[BlockKey] = set()
    for key, parent, workers in dump.entries:
        if key in seen:
            raise RouterIndexError(f"bad dump: block {key.hex()} is listed twice")
        if parent is not None and parent not in seen:
            raise RouterIndexError(
                f"bad dump: the parent of block {key.hex()} is not listed before it"
            )
        unlisted = [w for w in workers if w not in listed]
        if unlisted:
            raise RouterIndexError(
                f"bad dump: block {key.hex()} is held by {unlisted[0]}, not in its workers"
            )
        seen.add(key)
        if parent is not None:
            parents.add(parent)
    for key, _, workers in dump.entries:
        if not workers and key not in parents:
            raise RouterIndexError(
                f"bad dump: block {key.hex()} is held by no worker and continued by none"
            )
