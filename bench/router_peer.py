"""One index under measure, in a process of its own: `bench router`'s side by
side with Dynamo's indexer runs this once per implementation, Dynamo's in its
side environment (where only numpy and msgpack are importable besides it).

    python -m bench.router_peer --impl {dynamo,native,radix,flat} --stream FILE --out JSON

FILE (msgpack) holds `batches`, [[worker_id, [[kind, ids, parent], ...]], ...]
with kind "stored" / "removed" / "cleared" and blocks named by integer ids
(the trace's block ids: one id names one prefix), and `queries`, lists of
ids. Measured, the same way for every implementation:
- ingest: every batch applied in order, one call per event; the time of the
  calls (for Dynamo, whose calls only queue the event for its own thread,
  until a query behind them returns), and the longest single call (for
  ours, the longest the index is busy with one event; for Dynamo only the
  queueing, its thread's own time is not visible), by the wall clock and by
  the calling thread's CPU time (which leaves out the time the process was
  preempted: on a loaded machine the wall clock's longest call is mostly
  that);
- memory: the process's resident set growth over the ingest, per held block
  (batches are decoded one at a time and dropped, so the index is what grows);
- find_matches: each query once, the call alone timed (its answer, Dynamo's
  OverlapScores or ours, is read into plain scores after), the scores
  written out;
- remove_worker of `remove`: the call (and for Dynamo the query behind it);
  ours then sweeps its stale entries in the slices `router serve` runs, the
  longest slice reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Dynamo:
    def __init__(self) -> None:
        from dynamo._core import RadixTree

        self.tree = RadixTree()
        self.event_id = 0

    def prepare(self, batch: list[Any]) -> list[tuple[int, bytes]]:
        out = []
        wid = batch[0]
        for kind, ids, parent in batch[1]:
            self.event_id += 1
            if kind == "stored":
                blocks = [{"block_hash": i, "tokens_hash": i} for i in ids]
                data: Any = {"stored": {"parent_hash": parent, "blocks": blocks}}
            elif kind == "removed":
                data = {"removed": {"block_hashes": ids}}
            else:
                data = "cleared"
            out.append((wid, json.dumps({"event_id": self.event_id, "data": data}).encode()))
        return out

    def apply(self, prepared: list[tuple[int, bytes]]) -> tuple[int, int]:
        """Apply; the longest call (ns), wall clock and this thread's CPU time."""
        longest = longest_cpu = 0
        for wid, event in prepared:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            self.tree.apply_event(wid, event)
            longest = max(longest, time.perf_counter_ns() - t0)
            longest_cpu = max(longest_cpu, time.thread_time_ns() - c0)
        return longest, longest_cpu

    def sync(self) -> None:
        self.tree.find_matches([0])

    def prepare_query(self, ids: list[int]) -> list[int]:
        return ids

    def match(self, query: list[int]) -> Any:
        return self.tree.find_matches(query)

    @staticmethod
    def scores(found: Any) -> dict[int, int]:
        return {w: n for (w, _dp), n in found.scores.items()}

    def remove(self, wid: int) -> list[int]:
        t0 = time.perf_counter_ns()
        self.tree.remove_worker(wid)
        self.sync()
        return [time.perf_counter_ns() - t0]


class Ours:
    def __init__(self, impl: str) -> None:
        from router.router import Router

        self.router = Router(impl)

    def prepare(self, batch: list[Any]) -> tuple[Any, list[Any]]:
        from contract.events import Cleared, Removed, Stored
        from router.keys import worker

        events: list[Any] = []
        for kind, ids, parent in batch[1]:
            if kind == "stored":
                up = None if parent is None else self._keys([parent])[0]
                events.append(Stored(self._keys(ids), up))
            elif kind == "removed":
                events.append(Removed(self._keys(ids)))
            else:
                events.append(Cleared())
        return worker(batch[0]), events

    @staticmethod
    def _keys(ids: list[int]) -> list[bytes]:
        from contract.ids import keys_from_ints
        from router.keys import split_keys

        return split_keys(keys_from_ints(ids).tobytes())

    def apply(self, prepared: tuple[Any, list[Any]]) -> tuple[int, int]:
        """Apply; the longest call (ns), wall clock and this thread's CPU time."""
        w, events = prepared
        apply = self.router.apply
        longest = longest_cpu = 0
        for e in events:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            apply(w, (e,))
            longest = max(longest, time.perf_counter_ns() - t0)
            longest_cpu = max(longest_cpu, time.thread_time_ns() - c0)
        return longest, longest_cpu

    def sync(self) -> None:
        pass

    def prepare_query(self, ids: list[int]) -> list[bytes]:
        return self._keys(ids)

    def match(self, query: list[bytes]) -> Any:
        return self.router.index.find_matches(query)

    @staticmethod
    def scores(found: Any) -> dict[int, int]:
        return {w.worker_id: n for w, n in found.scores.items()}

    def remove(self, wid: int) -> list[int]:
        t0 = time.perf_counter_ns()
        self.router.remove_worker(wid)
        slices = [time.perf_counter_ns() - t0]
        more = True
        while more:
            t0 = time.perf_counter_ns()
            more = self.router.sweep()
            slices.append(time.perf_counter_ns() - t0)
        return slices


def measure(impl: str, stream: dict[str, Any]) -> dict[str, Any]:
    index: Any = Dynamo() if impl == "dynamo" else Ours(impl)
    batches, queries = stream["batches"], stream["queries"]
    gc.collect()
    # The stream's millions of lists out of the collector's sight: a real
    # router does not hold them, and its collections must not walk them.
    gc.freeze()
    rss0 = rss_bytes()
    apply_ns = 0
    event_max_ns = event_max_cpu_ns = 0
    blocks = 0
    for batch in batches:
        prepared = index.prepare(batch)
        blocks += sum(len(e[1]) for e in batch[1] if e[0] != "cleared")
        t0 = time.perf_counter_ns()
        longest, longest_cpu = index.apply(prepared)
        event_max_ns = max(event_max_ns, longest)
        event_max_cpu_ns = max(event_max_cpu_ns, longest_cpu)
        apply_ns += time.perf_counter_ns() - t0
        del prepared
    t0 = time.perf_counter_ns()
    index.sync()
    apply_ns += time.perf_counter_ns() - t0
    rss1 = rss_bytes()
    prepared_queries = [index.prepare_query(q) for q in queries]
    match_ns: list[int] = []
    scores: list[dict[int, int]] = []
    timed: Callable[[Any], Any] = index.match  # the call alone: its answer is read after
    for q in prepared_queries:
        t0 = time.perf_counter_ns()
        found = timed(q)
        match_ns.append(time.perf_counter_ns() - t0)
        scores.append(index.scores(found))
    remove = index.remove(stream["remove"])
    gc.unfreeze()
    return {
        "impl": impl,
        "event_blocks": blocks,
        "ingest_s": apply_ns / 1e9,
        "ingest_blocks_per_s": blocks / (apply_ns / 1e9),
        "ingest_event_max_ms": event_max_ns / 1e6,
        "ingest_event_max_cpu_ms": event_max_cpu_ns / 1e6,
        "rss_growth_bytes": rss1 - rss0,
        "match_ns": match_ns,
        "scores": [sorted(s.items()) for s in scores],
        "remove_call_ms": remove[0] / 1e6,
        "remove_slice_max_ms": max(remove) / 1e6,
        "remove_total_ms": sum(remove) / 1e6,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("dynamo", "native", "radix", "flat"), required=True)
    p.add_argument("--stream", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    stream = msgpack.unpackb(args.stream.read_bytes(), strict_map_key=False)
    args.out.write_text(json.dumps(measure(args.impl, stream)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
