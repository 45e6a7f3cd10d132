"""libCacheSim's algorithms on the same requests as `bench replay`, for comparison.

libCacheSim (PyPI `libcachesim`) is an optional bench dependency, kept out of
the project's environment: on first use it is installed, at a pinned
version, into a side virtual environment under the user's cache directory,
and it runs there as a subprocess (`libcachesim_worker.py`) fed with the
trace's block ids through two temporary files.

Both sides replay the same requests the same way: every block of a request
is accessed in order, and the request's hits are its leading run of hit
blocks. libCacheSim's `get` inserts each missed block (evicting per its
algorithm), as `bench replay`'s PUT stores each missed block. One difference
is inherent: libCacheSim caches objects, so it may keep a block after
evicting its parent; such a block is accessed (and may count as a hit for
the algorithm's own bookkeeping) but, after the request's first miss, adds
nothing to the request's hits. kvsidecar's radix index never keeps a block
without its parent.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachesim.trace import Trace
from sideenv import SideEnvError, ensure, python_of
from sideenv.specs import LIBCACHESIM

PEERS: dict[str, str] = {
    "LRU": "LRU",
    "ARC": "ARC",
    "LIRS": "LIRS",
    "S3FIFO": "S3FIFO",
    "SIEVE": "Sieve",
    "WTinyLFU": "WTinyLFU",
}
"""The algorithms compared: our label -> libcachesim's class name."""
WORKER = Path(__file__).resolve().parent / "libcachesim_worker.py"


class PeerError(RuntimeError):
    """The side environment could not be built or the peer run failed."""


@dataclass(frozen=True)
class PeerResult:
    version: str
    hits: dict[str, dict[int, int]]
    """label -> capacity -> leading-run block hits."""
    seconds: dict[str, dict[int, float]]


def side_env_python(root: Path | None = None) -> Path | None:
    """libCacheSim's interpreter when its side environment is installed."""
    return python_of(LIBCACHESIM, root)


def ensure_side_env(root: Path | None = None) -> Path:
    """libCacheSim's interpreter, installing its side environment first if needed."""
    try:
        return ensure(LIBCACHESIM, root)
    except SideEnvError as exc:
        raise PeerError(f"{exc}\nPass --no-peers to replay without libCacheSim.") from exc


def peer_hits(
    python: Path, trace: Trace, capacities: list[int], labels: list[str] | None = None
) -> PeerResult:
    """Leading-run hits of each libCacheSim algorithm at each capacity (in blocks)."""
    labels = list(PEERS) if labels is None else labels
    with tempfile.TemporaryDirectory(prefix="kvsidecar-peers-") as tmp:
        ids, offsets = Path(tmp) / "ids", Path(tmp) / "offsets"
        ids.write_bytes(np.ascontiguousarray(trace.block_ids, dtype=np.int64).tobytes())
        offsets.write_bytes(np.ascontiguousarray(trace.offsets, dtype=np.int64).tobytes())
        command = [
            str(python),
            str(WORKER),
            str(ids),
            str(offsets),
            ",".join(str(c) for c in capacities),
            ",".join(PEERS[label] for label in labels),
        ]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise PeerError(f"the libCacheSim run failed (exit {done.returncode}); see above")
    out = json.loads(done.stdout)
    by_class = {PEERS[label]: label for label in labels}
    return PeerResult(
        version=out["version"],
        hits={by_class[k]: {int(c): h for c, h in v.items()} for k, v in out["hits"].items()},
        seconds={by_class[k]: {int(c): s for c, s in v.items()} for k, v in out["seconds"].items()},
    )
