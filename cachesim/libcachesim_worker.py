"""Run inside the libCacheSim side environment (see cachesim/peers.py), not
imported by the project: it needs only the standard library and libcachesim.

    python libcachesim_worker.py IDS OFFSETS CAPACITIES ALGORITHMS

IDS and OFFSETS are files of native int64s: the flat block ids and the
per-request offsets, as in cachesim.trace.Trace. Each algorithm replays the
requests at each capacity (in blocks, one block = one object of size 1):
every block of a request is accessed in order with `get` (a miss inserts
it), and the request's hits are its leading run of hits, as `bench replay`
counts them. Prints {"version", "hits": {algorithm: {capacity: hits}},
"seconds": {...}} as JSON on stdout; a line per pass on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from array import array
from importlib.metadata import version

import libcachesim


def read_int64(path: str) -> array[int]:
    values = array("q")
    with open(path, "rb") as f:
        values.frombytes(f.read())
    return values


def leading_hits(cache: libcachesim.CacheBase, ids: array[int], offsets: array[int]) -> int:
    request = libcachesim.Request()
    request.obj_size = 1
    # The C++ cache's own get: the Python wrapper's call costs as much again
    # (libcachesim is pinned, see peers.py).
    get = getattr(cache, "_cache", cache).get
    hits = 0
    for r in range(len(offsets) - 1):
        blocks = ids[offsets[r] : offsets[r + 1]]
        run = 0
        for block in blocks:
            request.obj_id = block
            if not get(request):
                break
            run += 1
        hits += run
        for block in blocks[run + 1 :]:  # after the first miss: accessed, not counted
            request.obj_id = block
            get(request)
    return hits


def main(argv: list[str]) -> int:
    ids, offsets = read_int64(argv[1]), read_int64(argv[2])
    capacities = [int(c) for c in argv[3].split(",")]
    algorithms = argv[4].split(",")
    hits: dict[str, dict[str, int]] = {}
    seconds: dict[str, dict[str, float]] = {}
    for name in algorithms:
        hits[name], seconds[name] = {}, {}
        for capacity in capacities:
            start = time.perf_counter()
            cache = getattr(libcachesim, name)(capacity)
            hits[name][str(capacity)] = leading_hits(cache, ids, offsets)
            seconds[name][str(capacity)] = time.perf_counter() - start
            print(
                f"libcachesim {name} @ {capacity:,}: {seconds[name][str(capacity)]:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    json.dump({"version": version("libcachesim"), "hits": hits, "seconds": seconds}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
