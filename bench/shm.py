"""`kvsidecar bench shm`: engine-side block copies between paged KV tensors and shm slots.

Each case is a block size and a layer count (`2048x32`: 2 MiB blocks of 32
layers x 64 KiB, so one copy range is 64 KiB). It fills engine tensors of N
blocks per layer and a fresh prefaulted shm pool of N slots, then copies all
N blocks engine -> shm (save, the D2H side of a PUT) and shm -> engine (load,
the H2D side of a GET), with block ids and slots two random permutations.

The floor, measured in the same run and interleaved with the copies: the
faster of two raw copies of the same total bytes between a page-aligned
anonymous buffer and the prefaulted shm segment (the pool is one segment
here), in each direction: numpy.copyto (one thread, libc memcpy), and the
C extension's copy over the buffers as one contiguous run of 1 MiB pieces
with the threads and streaming stores the block copy uses for that many
bytes (`floor_raw_*`; without the extension only numpy's). Figures are GB/s
(1 GB = 1e9 B), medians over --repeats; ratio = achieved / floor. The
pool's prefault time (fallocate + populate of every page) is reported too.
The machine's memory bandwidth drifts: compare ratios, not absolute figures
from different runs. Target: save and load of the 2 MiB-block cases >=
0.8 x floor (`targets` in the JSON).

After the timed rounds, each copy is checked through the very call that was
timed: up to 8 blocks (random ids and slots) have their slots cleared and
are saved again, then their engine blocks cleared and loaded again; their
bytes must be what they were before the run, or the case is an error.

With `--layout` a vLLM KV cache layout (`LHBNC`, `BLHNC`, ...), the engine
side is instead one allocation in that layout with --heads KV heads, copied
through its strided runs as the connector copies it (cuda_ext's "strided"
layout, coalesced: a cross-layer block is one range, a head-outer one a range
per head); the floor is the same memcpy.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from bench.targets import Target, at_least, verdict
from cachesim.report import print_table, time_interleaved, write_json
from engine_shim.kvconnector.geometry import LAYOUT_ORDERS
from shm import copy as shm_copy
from shm.layout import BlockLayout
from shm.pool import ShmPool

DEFAULT_CASES = "64x8,512x16,2048x32,2048x1"
QUICK_CASES = "64x8,2048x32,2048x1"
TARGET_VS_FLOOR = 0.8  # for 2 MiB blocks
CHECKED_BLOCKS = 8  # per case, after the timed rounds


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "shm",
        help="block copies between engine KV tensors and shm slots, against raw memcpy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cases",
        type=_cases,
        default=None,
        help=f"BLOCK_KIBxLAYERS,... (default {DEFAULT_CASES})",
    )
    p.add_argument("--total-mib", type=int, default=None, help="bytes copied per case (1024)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per figure (5)")
    p.add_argument(
        "--impls",
        default=",".join(shm_copy.IMPLS),
        help=f"copy implementations to time (available: {','.join(shm_copy.IMPLS)})",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="cap on the C copy's threads (default: auto)"
    )
    p.add_argument(
        "--layout",
        choices=("layers", *LAYOUT_ORDERS),
        default="layers",
        help="engine tensors: one contiguous tensor per layer (default), or a vLLM KV cache layout",
    )
    p.add_argument("--heads", type=int, default=8, help="KV heads of a --layout allocation (8)")
    p.add_argument("--quick", action="store_true", help="small sizes, for the test suite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


def _cases(text: str) -> list[tuple[int, int]]:
    """argparse type for "64x8,2048x1": (block KiB, layers) pairs."""
    cases = []
    for part in text.split(","):
        try:
            kib, layers = (int(v) for v in part.lower().split("x"))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected BLOCK_KIBxLAYERS, got {part!r}") from exc
        if kib <= 0 or layers <= 0 or (kib * 1024) % layers:
            raise argparse.ArgumentTypeError(f"{part}: layers must divide a positive block size")
        cases.append((kib, layers))
    return cases


def case_name(kib: int, layers: int) -> str:
    return f"{kib}x{layers}"


def measure_case(
    kib: int,
    layers: int,
    total: int,
    impls: list[str],
    repeats: int,
    seed: int,
    threads: int | None = None,
    vllm_layout: str | None = None,
    heads: int = 8,
) -> dict[str, Any]:
    """Copy `total` bytes of `kib`-KiB blocks each way; GB/s per impl and the floor."""
    import torch

    page = kib * 1024 // layers
    n = max(1, total // (kib * 1024))
    if vllm_layout is None:
        kv = [torch.full((n, page), i + 1, dtype=torch.uint8) for i in range(layers)]
    else:
        kv = _layout_planes(vllm_layout, n, layers, page, heads)
    layout = BlockLayout(len(kv), int(kv[0].shape[1]))
    nbytes = n * layout.block_bytes
    rng = np.random.default_rng(seed)
    blocks, slots = rng.permutation(n), rng.permutation(n)
    tags = torch.arange(n, dtype=torch.int32).view(torch.uint8).reshape(n, 4)
    for i, tensor in enumerate(kv):  # each block starts with its id, so a misplaced block shows
        width = min(4, layout.layer_block_bytes)
        tensor[:, width:] = i % 255 + 1
        tensor[:, :width] = tags[:, :width]
    picks = np.unique(np.linspace(0, n - 1, min(n, CHECKED_BLOCKS)).astype(np.int64))
    expected = [[tensor[int(blocks[i])].clone() for tensor in kv] for i in picks]
    # A page-aligned anonymous buffer, faulted in: the floor's engine side.
    plain = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    plain[:] = 1
    prefix = f"kvsbench.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    pool_bytes = n * layout.slot_stride
    with ShmPool.create(prefix, pool_bytes, segment_bytes=_segment_bytes(pool_bytes)) as pool:
        shm = pool.segment_view(0)[:nbytes]
        copies = {}
        for impl in impls:
            args = (kv, blocks, pool, slots, layout, 0)
            opts = {"impl": impl, "threads": threads}
            copies[f"save_{impl}"] = partial(shm_copy.save_blocks, *args, **opts)
            copies[f"load_{impl}"] = partial(shm_copy.load_blocks, *args, **opts)
        floors = {
            "floor_numpy_save": partial(np.copyto, shm, plain),
            "floor_numpy_load": partial(np.copyto, plain, shm),
        }
        if "c" in impls:
            floors.update(_raw_floors(plain, shm, threads))
        times = time_interleaved({**floors, **copies}, repeats)
        check = _ByteCheck(pool, kv, layout, blocks[picks], slots[picks], expected)
        for impl in impls:
            check.save(copies[f"save_{impl}"], impl)
            check.load(copies[f"load_{impl}"], impl)
        result = {
            "block_kib": kib,
            "layers": layers,
            "layout": vllm_layout or "layers",
            "ranges_per_block": len(kv),
            "range_bytes": layout.layer_block_bytes,
            "blocks": n,
            "bytes": nbytes,
            "prefault_seconds": pool.prefault_seconds,
            "prefault_gbps": pool.nbytes / pool.prefault_seconds / 1e9,
            "prefault_method": pool.prefault_method,
            "pool_bytes": pool.nbytes,
        }
    result.update({f"{k}_gbps": nbytes / statistics.median(v) / 1e9 for k, v in times.items()})
    for d in ("save", "load"):
        kinds = [k for k in ("numpy", "raw") if f"floor_{k}_{d}_gbps" in result]
        best = max(kinds, key=lambda k: result[f"floor_{k}_{d}_gbps"])
        result[f"floor_{d}_gbps"], result[f"floor_{d}_kind"] = (
            result[f"floor_{best}_{d}_gbps"],
            best,
        )
    return result


def _layout_planes(vllm_layout: str, n: int, layers: int, page: int, heads: int) -> list:
    """The uint8 planes, as the copiers copy them (coalesced), of one
    allocation of n blocks in `vllm_layout`, each layer's page `page` bytes."""
    import torch

    from cuda_ext.layouts import kv_planes
    from engine_shim.kvconnector.geometry import KVGeometry

    geometry = KVGeometry(vllm_layout, num_layers=layers, block_size=1, num_kv_heads=heads,
                          head_dim=1, dtype=torch.uint8, block_elems=page)  # fmt: skip
    return list(kv_planes(geometry.stand_in(n), "strided").coalesced().planes)


RAW_PIECE_BYTES = 1 << 20


def _raw_floors(plain: np.ndarray, shm: np.ndarray, threads: int | None) -> dict[str, Any]:
    """The C copy of one contiguous run, in 1 MiB pieces, with the threads and
    streaming stores `shm.copy` picks for a save or a load of this many bytes."""
    nbytes = plain.nbytes
    piece = min(RAW_PIECE_BYTES, nbytes)
    count = nbytes // piece  # the bench's totals are whole MiB
    starts = np.arange(count, dtype=np.uint64) * np.uint64(piece)
    a, b = starts + np.uint64(plain.ctypes.data), starts + np.uint64(shm.ctypes.data)
    most = threads or shm_copy.MAX_THREADS
    used, save_stream = shm_copy.copy_settings(nbytes, most, save=True)
    _, load_stream = shm_copy.copy_settings(nbytes, most, save=False)
    copy = shm_copy._blockcopy.copy
    return {
        "floor_raw_save": partial(copy, a, b, piece, used, save_stream),
        "floor_raw_load": partial(copy, b, a, piece, used, load_stream),
    }


def _segment_bytes(pool_bytes: int) -> int:
    """One segment for the whole pool, so the floor copies into a single mapping."""
    return -(-pool_bytes // 4096) * 4096


class _ByteCheck:
    """A benchmark that copies the wrong bytes measures nothing. Some blocks of
    a case, with what their engine blocks held before the run (`expected`, a
    tensor per range); `save` and `load` clear one side of them, run a timed
    copy of the whole case, and compare."""

    def __init__(
        self,
        pool: ShmPool,
        kv: list,
        layout: BlockLayout,
        blocks: np.ndarray,
        slots: np.ndarray,
        expected: list[list[Any]],
    ) -> None:
        self.pool, self.kv, self.layout, self.expected = pool, kv, layout, expected
        self.blocks, self.slots = [int(b) for b in blocks], [int(s) for s in slots]

    def save(self, copy: Callable[[], object], impl: str) -> None:
        views = [self.pool.slot_view(s, self.layout.slot_stride) for s in self.slots]
        for view in views:
            view[:] = 0
        copy()
        for k, view in enumerate(views):
            for layer, want in enumerate(self.expected[k]):
                start = self.layout.offset(0, layer)
                got = view[start : start + self.layout.layer_block_bytes]
                self._compare(got, want, f"saved slot of block {self.blocks[k]}", layer, impl)

    def load(self, copy: Callable[[], object], impl: str) -> None:
        for block in self.blocks:
            for tensor in self.kv:
                tensor[block] = 0
        copy()
        for k, block in enumerate(self.blocks):
            for layer, want in enumerate(self.expected[k]):
                got = self.kv[layer][block].numpy()
                self._compare(got, want, f"loaded block {block}", layer, impl)

    @staticmethod
    def _compare(got: np.ndarray, want: Any, what: str, layer: int, impl: str) -> None:
        if not np.array_equal(got, want.numpy()):
            raise RuntimeError(f"{what} differs in range {layer} ({impl}): the copy is broken")


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("bench shm needs torch: pip install -e '.[torch]'", file=sys.stderr)
        return 2
    impls = [i for i in args.impls.split(",") if i]
    unknown = sorted(set(impls) - set(shm_copy.IMPLS))
    if unknown or not impls:
        print(f"unknown or unavailable impls {unknown}; have {shm_copy.IMPLS}", file=sys.stderr)
        return 2
    cases = args.cases or _cases(QUICK_CASES if args.quick else DEFAULT_CASES)
    total = (args.total_mib or (16 if args.quick else 1024)) << 20
    repeats = args.repeats or (2 if args.quick else 5)
    by_case: dict[str, dict[str, Any]] = {}
    for i, (kib, layers) in enumerate(cases):
        name = case_name(kib, layers)
        print(f"case {name}: {total >> 20} MiB each way ...", file=sys.stderr, flush=True)
        layout = None if args.layout == "layers" else args.layout
        by_case[name] = measure_case(
            kib, layers, total, impls, repeats, args.seed + i, args.threads, layout, args.heads
        )
    result = _summary(by_case, impls, total, repeats)
    result["copy_threads"] = args.threads or shm_copy.MAX_THREADS
    result["quick"] = bool(args.quick)
    result["layout"] = args.layout
    result["seed"] = args.seed
    print_table(
        ("case", "range KiB", "impl", "save GB/s", "load GB/s", "floor save", "floor load",
         "save/floor", "load/floor"),
        _rows(by_case, impls),
    )  # fmt: skip
    print(
        f"prefault: {result['prefault_gbps']:.2f} GB/s ({result['prefault_method']}); "
        f"memcpy floor {result['memcpy_floor_gbps']:.2f} GB/s (per case the faster of "
        "numpy.copyto and the raw C copy with the block copy's threads); "
        f"target save/load >= {TARGET_VS_FLOOR} x floor for 2 MiB blocks"
    )
    result["targets"] = targets(by_case, impls[0])
    print(verdict(result["targets"]))
    if args.json:
        write_json(args.json, result)
    return 0


def targets(by_case: dict[str, dict[str, Any]], impl: str) -> dict[str, Target]:
    """`save.<case>` and `load.<case>` of the 2 MiB-block cases (smaller
    blocks are reported, not held to it: their ranges are a few KiB)."""
    out: dict[str, Target] = {}
    for d in ("save", "load"):
        rule = f"{d} GB/s / the memcpy floor's, 2 MiB blocks, >= {TARGET_VS_FLOOR:g}"
        for name, c in by_case.items():
            if c["block_kib"] == 2048:
                ratio = c[f"{d}_{impl}_gbps"] / c[f"floor_{d}_gbps"]
                out[f"{d}.{name}"] = at_least(ratio, TARGET_VS_FLOOR, rule)
    return out


def _summary(
    by_case: dict[str, dict[str, Any]], impls: list[str], total: int, repeats: int
) -> dict[str, Any]:
    main = impls[0]
    floors = [c[f"floor_{d}_gbps"] for c in by_case.values() for d in ("save", "load")]
    result: dict[str, Any] = {
        "impl": main,
        "impls": impls,
        "stream_kind": getattr(shm_copy._blockcopy, "STREAM_KIND", None),
        "total_bytes_per_case": total,
        "repeats": repeats,
        "memcpy_floor_gbps": statistics.median(floors),
        "prefault_gbps": statistics.median(c["prefault_gbps"] for c in by_case.values()),
        "prefault_seconds_per_gib": statistics.median(
            c["prefault_seconds"] / c["pool_bytes"] * (1 << 30) for c in by_case.values()
        ),
        "prefault_method": next(iter(by_case.values()))["prefault_method"],
    }
    for d in ("save", "load"):
        result[f"{d}_gbps"] = {k: c[f"{d}_{main}_gbps"] for k, c in by_case.items()}
        result[f"floor_{d}_gbps"] = {k: c[f"floor_{d}_gbps"] for k, c in by_case.items()}
        result[f"floor_{d}_kind"] = {k: c[f"floor_{d}_kind"] for k, c in by_case.items()}
        for kind in ("numpy", "raw"):
            figures = {k: c.get(f"floor_{kind}_{d}_gbps") for k, c in by_case.items()}
            if all(v is not None for v in figures.values()):
                result[f"floor_{kind}_{d}_gbps"] = figures
        result[f"{d}_vs_floor"] = {
            k: c[f"{d}_{main}_gbps"] / c[f"floor_{d}_gbps"] for k, c in by_case.items()
        }
        for impl in impls[1:]:
            result[f"{d}_gbps_{impl}"] = {k: c[f"{d}_{impl}_gbps"] for k, c in by_case.items()}
    result["by_case"] = by_case
    return result


def _rows(by_case: dict[str, dict[str, Any]], impls: list[str]) -> list[tuple]:
    rows = []
    for name, c in by_case.items():
        for impl in impls:
            save, load = c[f"save_{impl}_gbps"], c[f"load_{impl}_gbps"]
            fs, fl = c["floor_save_gbps"], c["floor_load_gbps"]
            kib = c["range_bytes"] / 1024
            rows.append((name, kib, impl, save, load, fs, fl, save / fs, load / fl))
    return rows
