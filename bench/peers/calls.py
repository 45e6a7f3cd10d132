"""The per-call cases of `kvsidecar bench control`, run the same way for every system.

Every system (kvsidecar, the memcpy floor, AIBrix's L1 cache, LMCache's
multiprocess server) runs in a process of its own, usually in its own side
environment, as `python -m bench.peers.<name>_worker`: it reads a `Spec` as
JSON on stdin, runs `run_cases` over its `System`, and prints
{"version", "rows", "notes"} as JSON on stdout (progress on stderr). The
process exits after its rows, so the gigabytes one system held are free
before the next starts.

This module needs only the standard library and numpy: it is imported in
the peers' side environments, with the project's root on sys.path.

Cases, for each geometry (`GEOMETRIES`: Llama-3-8B's 128 KiB a token in
blocks of 16 tokens = 2 MiB, and of 1 token = 128 KiB):
- save.<geometry>.<n>: save n blocks no system holds, until done (a saved
  prefix is forgotten untimed after each call, so the next one stores again);
- load.<geometry>.<n>: load the first n blocks of a pre-saved prefix into the
  engine's KV tensors, until done;
- in the lookup geometry only, lookup_hit.<tokens> (a pre-saved prompt,
  every block hits) and lookup_miss.<tokens> (a prompt whose first block
  misses): the call an engine makes for every arriving request.
Every call is checked once (warm-up) for the tokens it should give, so a
row never silently times a miss.

Paired floor (`Spec.paired_floor`, kvsidecar's worker): the memcpy floor
also runs inside the worker, and every timed save or load of the largest
transfer (the rows the floor's target judges) is paired with the floor's
call of the same row right before or after it (alternating).
The row then carries `vs_floor`, the median over the pairs of the floor's
time over the system's, and `floor_p50`. Memory speed on these VMs moves
by up to 2x between phases a few seconds apart, so p50s taken in separate
phases can give either side the fast memory; pairs cannot. kvsidecar's
floor copies in kvsidecar's own memory (the engine's tensors and the
cache's slots: bench/peers/kvsidecar_worker.py, SameMemoryFloor), since
two buffers of one kind can differ in speed for as long as they live. A
floor with buffers of its own (`own_buffers`, MemcpyFloor) pairs only
where they fit beside the system's (`floor_fits`); else the geometry's
rows are left unpaired and say so in the worker's notes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

GEOMETRIES: dict[str, dict[str, Any]] = {
    # Llama-3-8B: 32 layers x K/V x 8 KV heads x 128 x fp16 = 128 KiB a token
    "2MiB": {"num_layers": 32, "tokens_per_block": 16, "num_kv_heads": 8, "head_dim": 128},
    "128KiB": {"num_layers": 32, "tokens_per_block": 1, "num_kv_heads": 8, "head_dim": 128},
}
"""Block geometries (fp16): 2 MiB blocks of 16 tokens (vLLM's default page),
128 KiB blocks of one token (SGLang's default page size)."""
LOOKUP_GEOMETRY = "2MiB"
TOKEN_STRIDE = 10_000_000
LOOKUP_SET, SAVE_SET, MISS_SET = 0, 1, 2
"""Token-sequence seeds: the pre-saved set (loads, lookup hits), the saved
one (forgotten after each save) and one never saved (first-block misses)."""


def layer_block_bytes(geometry: dict[str, Any]) -> int:
    """Bytes of one layer of one block: K and V, fp16."""
    g = geometry
    return 2 * g["tokens_per_block"] * g["num_kv_heads"] * g["head_dim"] * 2


def block_bytes(geometry: dict[str, Any]) -> int:
    return geometry["num_layers"] * layer_block_bytes(geometry)


def token_ids(num_tokens: int, seed: int) -> np.ndarray:
    """A prompt; prompts of different seeds share no block."""
    return np.arange(num_tokens, dtype=np.int64) + seed * TOKEN_STRIDE


@dataclass(frozen=True)
class Spec:
    """What one worker measures."""

    transfer_blocks: list[int] = field(default_factory=lambda: [1, 32, 2048])
    lookup_tokens: list[int] = field(default_factory=lambda: [256, 2048, 16384])
    geometries: list[str] = field(default_factory=lambda: list(GEOMETRIES))
    seconds: float = 0.5
    """Timed seconds of each case (at least min_samples calls)."""
    min_samples: int = 5
    warmup: int = 2
    workdir: str = "/tmp"
    """Where a worker may put sockets and scratch files."""
    paired_floor: bool = False
    """Pair the saves and loads of the largest transfer with the memcpy
    floor's (module docstring)."""
    paired_min_samples: int = 11
    """Pairs a paired row times at least: its figure is their median, and a
    2,048 x 2 MiB row gets only ~2 pairs a second."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Spec:
        return Spec(**json.loads(text))

    def lookups(self, geometry: str) -> list[int]:
        """The lookup prompts measured in this geometry (tokens)."""
        return self.lookup_tokens if geometry == LOOKUP_GEOMETRY else []

    def kv_blocks(self, geometry: str) -> int:
        """Engine KV blocks a system allocates, and the pre-saved set: the
        largest transfer, or the longest lookup prompt if longer."""
        tpb = GEOMETRIES[geometry]["tokens_per_block"]
        return max([*self.transfer_blocks, *(t // tpb for t in self.lookups(geometry))])

    def cache_blocks(self, geometry: str) -> int:
        """The cache's size in blocks: the pre-saved set with a quarter to
        spare (for eviction watermarks). The save rows run first, and each
        saved prefix is forgotten after its call, so they fit in it too."""
        return self.kv_blocks(geometry) * 5 // 4 + 16


class System(Protocol):
    """One system under test, open on one geometry at a time. Every method
    returns the tokens it saved, loaded or found."""

    def open(self, geometry: dict[str, Any], kv_blocks: int, cache_blocks: int) -> None: ...
    def save(self, tokens: np.ndarray, block_ids: np.ndarray) -> int: ...
    def forget(self, tokens: np.ndarray) -> None: ...
    def load(self, tokens: np.ndarray, block_ids: np.ndarray) -> int: ...
    def lookup(self, tokens: np.ndarray) -> int: ...
    def prepare_load(self, tokens: np.ndarray) -> None:
        """Untimed, before every load: what the system's engine integration
        does first (LMCache: the lookup that locks what a retrieve reads)."""

    def tidy(self) -> None:
        """Untimed, after every load and lookup: release what the call left
        held (e.g. a peer's read locks), as an engine does once a request is done."""

    def close(self) -> None: ...


def summarize(latency_ns: list[int]) -> dict[str, float]:
    lat = np.asarray(latency_ns, dtype=np.float64) / 1e3
    return {
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "mean": float(lat.mean()),
        "samples": int(lat.size),
    }


def timed(
    step: Callable[[], int],
    want: int,
    what: str,
    spec: Spec,
    after: Callable[[], None] | None = None,
    before: Callable[[], None] | None = None,
    floor: Callable[[], int] | None = None,
) -> dict[str, float]:
    """Warm up (checking each call gives `want` tokens), then time calls for
    spec.seconds and at least spec.min_samples; `before` and `after` run
    untimed around each call. `floor`: the floor's call of the same row,
    timed right before the step in even samples and right after it in odd
    ones, at least spec.paired_min_samples pairs (module docstring: paired
    floor)."""
    for _ in range(max(1, spec.warmup)):
        if before is not None:
            before()
        got = step()
        if got != want:
            raise RuntimeError(f"{what} gave {got} tokens, expected {want}")
        if after is not None:
            after()
        if floor is not None:
            floor()
    clock = time.perf_counter_ns
    latencies: list[int] = []
    floors: list[int] = []

    def floor_call() -> None:
        assert floor is not None
        t0 = clock()
        floor()
        floors.append(clock() - t0)

    least = spec.min_samples if floor is None else max(spec.min_samples, spec.paired_min_samples)
    end = clock() + int(spec.seconds * 1e9)
    while True:
        if floor is not None and len(latencies) % 2 == 0:
            floor_call()
        if before is not None:
            before()
        t0 = clock()
        step()
        t1 = clock()
        latencies.append(t1 - t0)
        if after is not None:
            after()
        if floor is not None and len(floors) < len(latencies):
            floor_call()
        if clock() >= end and len(latencies) >= least:
            break
    row = summarize(latencies)
    if floor is not None:
        row["floor_p50"] = summarize(floors)["p50"]
        row["vs_floor"] = float(np.median(np.asarray(floors) / np.asarray(latencies)))
    return row


def floor_fits(floor_bytes: int, margin: int = 2 << 30) -> bool:
    """Whether the paired floor's buffers fit in the memory available now,
    with `margin` to spare (MemAvailable). Asked once the system is open:
    kvsidecar's sidecar allocates its whole CPU tier at start."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return False
    return floor_bytes + margin <= available


class PairedFloor:
    """The memcpy floor a worker pairs its largest saves and loads with, in
    one geometry (module docstring: paired floor). Opened at the first such
    row, so that no other row runs right after its buffers are faulted in;
    not at all where spec.paired_floor is off or its buffers do not fit
    (then a line in `notes` says so)."""

    def __init__(
        self, make: Callable[[], System] | None, spec: Spec, gname: str, notes: list[str]
    ) -> None:
        self._make, self._spec, self._gname, self._notes = make, spec, gname, notes
        self._largest = max(spec.transfer_blocks)
        self._refused = not spec.paired_floor or make is None
        self.system: System | None = None

    def call(self, kind: str, tokens: np.ndarray, ids: np.ndarray) -> Callable[[], int] | None:
        """The floor's call to pair a `kind` ("save" or "load") of `ids` with, or None."""
        floor = self._for_row(len(ids))
        if floor is None:
            return None
        step = floor.save if kind == "save" else floor.load
        return lambda: step(tokens, ids)

    def _for_row(self, blocks: int) -> System | None:
        if self._refused or blocks != self._largest:
            return None
        if self.system is None:
            assert self._make is not None
            spec, gname, geometry = self._spec, self._gname, GEOMETRIES[self._gname]
            floor = self._make()
            # A floor of buffers of its own (MemcpyFloor) needs room for them.
            own = getattr(floor, "own_buffers", True)
            if own and not floor_fits(2 * spec.kv_blocks(gname) * block_bytes(geometry)):
                self._refused = True
                self._notes.append(f"{gname}: not paired with the floor (too little memory)")
                return None
            floor.open(geometry, spec.kv_blocks(gname), spec.cache_blocks(gname))
            self.system = floor
        return self.system

    def close(self) -> None:
        if self.system is not None:
            self.system.close()
            self.system = None


def run_cases(
    system: System,
    spec: Spec,
    name: str,
    make_floor: Callable[[], System] | None = None,
    notes: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Every row of `spec` for one system: {row name: latency summary (µs)}.
    `make_floor`: the memcpy floor, paired with the largest saves and loads
    where spec.paired_floor (PairedFloor; `notes` gets what it has to say)."""
    rows: dict[str, dict[str, float]] = {}
    said = notes if notes is not None else []
    for gname in spec.geometries:
        geometry = GEOMETRIES[gname]
        tpb = geometry["tokens_per_block"]
        log(f"{name}: {gname} blocks ...")
        system.open(geometry, spec.kv_blocks(gname), spec.cache_blocks(gname))
        floor = PairedFloor(make_floor, spec, gname, said)
        try:
            for n in spec.transfer_blocks:
                tokens, ids = token_ids(n * tpb, SAVE_SET), np.arange(n)
                rows[f"save.{gname}.{n}"] = timed(
                    lambda t=tokens, i=ids: system.save(t, i),
                    n * tpb,
                    f"{name} save of {n} blocks",
                    spec,
                    after=lambda t=tokens: system.forget(t),
                    floor=floor.call("save", tokens, ids),
                )
            presave(system, spec.kv_blocks(gname), tpb)
            for n in spec.transfer_blocks:
                tokens, ids = token_ids(n * tpb, LOOKUP_SET), np.arange(n)
                rows[f"load.{gname}.{n}"] = timed(
                    lambda t=tokens, i=ids: system.load(t, i),
                    n * tpb,
                    f"{name} load",
                    spec,
                    after=system.tidy,
                    before=lambda t=tokens: system.prepare_load(t),
                    floor=floor.call("load", tokens, ids),
                )
            floor.close()
            for t in spec.lookups(gname):
                hit, miss = token_ids(t, LOOKUP_SET), token_ids(t, MISS_SET)
                rows[f"lookup_hit.{t}"] = timed(
                    lambda x=hit: system.lookup(x), t, f"{name} lookup hit", spec, system.tidy
                )
                rows[f"lookup_miss.{t}"] = timed(
                    lambda x=miss: system.lookup(x), 0, f"{name} lookup miss", spec, system.tidy
                )
        finally:
            floor.close()
            system.close()
    return rows


def presave(system: System, blocks: int, tpb: int) -> None:
    """Save the lookup set (every engine block), untimed, in one call."""
    got = system.save(token_ids(blocks * tpb, LOOKUP_SET), np.arange(blocks))
    if got != blocks * tpb:
        raise RuntimeError(f"pre-saving {blocks} blocks gave {got} tokens")


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def worker_main(
    make: Callable[[Spec], System],
    version: str,
    name: str,
    notes: str = "",
    make_floor: Callable[[], System] | None = None,
) -> int:
    """A worker's main: a Spec on stdin, {"version", "rows", "notes"} on
    stdout. `make_floor`: the memcpy floor, for spec.paired_floor."""
    spec = Spec.from_json(sys.stdin.read())
    said: list[str] = [notes] if notes else []
    rows = run_cases(make(spec), spec, name, make_floor, said)
    json.dump({"version": version, "rows": rows, "notes": "; ".join(said)}, sys.stdout)
    sys.stdout.flush()
    return 0
