"""`kvsidecar bench gpu`: GPU <-> shm block copies (cuda_ext) against one cudaMemcpyAsync.

Each case is a model geometry and a block count. It allocates the engine's KV
cache on the GPU (--layout, bf16, 16-token blocks, twice as many blocks as
copied, random bytes), a prefaulted shm pool of one slot per copied block,
pins and maps the pool (its registration time is reported), then times both
copy paths, "sm" (kernel) and "dma" (copy engines), each way: D2H (save) and
H2D (load, with per-layer events), block ids and slots random permutations.

The floor, measured in the same run and interleaved with the copies: one
cudaMemcpyAsync of the same total bytes between a contiguous GPU buffer and
the same pinned pool, each way. Every figure is measured alone and with a
bf16 matmul running on another stream. Figures are GB/s (1 GB = 1e9 B) of
host wall time from enqueue to completion, medians over --repeats;
ratio = achieved / floor. Target: the path "auto" picks reaches 0.85 x floor
at 1,024 blocks, each way (`targets` in the JSON).

"queued" figures time the same ops (and the floor) on the GPU when queued
behind other GPU work, as an engine queues a save behind its forward pass:
then the op's host part (argument checks, index upload, launches: a few
hundred microseconds of Python) overlaps that work instead of delaying the
copy. Wall time counts it; queued time does not.

Without a GPU, a driver or the built library it says so, measures nothing,
writes JSON saying so (--json) and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from bench.targets import Target, at_least, verdict
from cachesim.report import positive_int_list, print_table, time_interleaved, write_json
from engine_shim.kvconnector.geometry import LAYOUT_ORDERS

TARGET_VS_FLOOR = 0.85
TARGET_BLOCKS = 1024
TOKENS_PER_BLOCK = 16
LAYOUTS = ("vllm_flash", "flashinfer", "cross_layer", *LAYOUT_ORDERS)
"""cuda_ext layouts, and vLLM 0.33 KV cache layouts (per-layer views of one
allocation, copied as cuda_ext's "strided" layout, as the connector does)."""
PATHS = ("sm", "dma")
MATMUL_SIZE = 8192
# A GPU sleep (~2.5 ms at 2 GHz) longer than any op's host part, for the
# "queued" figures.
QUEUED_SLEEP_CYCLES = 5_000_000


class Model(NamedTuple):
    layers: int
    kv_heads: int
    head_dim: int


MODELS = {
    "llama3-8b": Model(32, 8, 128),  # 2 MiB per block, 32 KiB K or V chunks
    "qwen2.5-0.5b": Model(24, 2, 64),  # small heads: 192 KiB per block, 4 KiB chunks
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gpu",
        help="GPU <-> shm block copies (sm kernel and DMA) against one cudaMemcpyAsync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default=",".join(MODELS), help=f"of {','.join(MODELS)}")
    p.add_argument("--blocks", type=positive_int_list, default=None, help="(64,1024)")
    p.add_argument("--layout", choices=LAYOUTS, default="vllm_flash")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per figure (5)")
    p.add_argument("--no-contention", action="store_true", help="skip the matmul runs")
    p.add_argument(
        "--max-ctas", type=int, default=None, help="the sm path's CTAs (default 8 saves, 16 loads)"
    )
    p.add_argument(
        "--shm-dir",
        metavar="DIR",
        help="put the pool in DIR (a hugetlbfs or huge=always tmpfs mount) instead of /dev/shm",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, for the test suite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


def unavailable_reason() -> str | None:
    """Why no GPU copy can run here, or None when one can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    from cuda_ext import _lib

    try:
        _lib.probe()
    except _lib.GpuUnavailable as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return f"libkvcopy sees a GPU but torch {torch.__version__} does not"
    return None


def run(args: argparse.Namespace) -> int:
    models = [m for m in args.models.split(",") if m]
    if not models or set(models) - set(MODELS):
        print(f"unknown models {args.models!r}; have {','.join(MODELS)}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench gpu: no GPU copy path on this machine, nothing measured: {reason}")
        if args.json:
            write_json(args.json, {"benchmark": "gpu", "skipped": True, "reason": reason})
        return 0
    blocks = args.blocks or ([8, 64] if args.quick else [64, TARGET_BLOCKS])
    repeats = args.repeats or (2 if args.quick else 5)
    cases: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(models):
        for n in blocks:
            print(f"case {name}/{n} ...", file=sys.stderr, flush=True)
            cases[f"{name}/{n}"] = measure_case(
                MODELS[name],
                n,
                args.layout,
                repeats,
                args.seed + i,
                not args.no_contention,
                args.shm_dir,
                args.max_ctas,
            )
    result = _summary(cases, args)
    print_table(
        (
            "case",
            "MiB",
            "path",
            "dir",
            "GB/s",
            "floor",
            "ratio",
            "queued ratio",
            "w/ matmul",
            "ratio",
            "mm slow",
        ),
        _rows(cases),
    )
    for name, case in cases.items():
        print(
            f"{name}: register {case['register_seconds']:.3f} s "
            f"({case['register_gbps']:.1f} GB/s); auto picks {case['auto_path']}; "
            f"dma via {case['dma_kind']}"
            + (f" (batch refused: {case['batch_error']})" if case["batch_error"] else "")
        )
    print(f"target: auto >= {TARGET_VS_FLOOR} x floor at {TARGET_BLOCKS} blocks")
    print(verdict(result["targets"]))
    if args.json:
        write_json(args.json, result)
    return 0


def measure_case(
    model: Model,
    n: int,
    layout_name: str,
    repeats: int,
    seed: int,
    contention: bool,
    shm_dir: str | None = None,
    max_ctas: int | None = None,
) -> dict[str, Any]:
    import torch

    from cuda_ext import _lib
    from cuda_ext.gpu import GpuBlockCopier
    from cuda_ext.layouts import kv_planes
    from shm.pool import ShmPool
    from shm.segments import place_of

    device = torch.device("cuda", torch.cuda.current_device())
    kv = _engine_kv(model, 2 * n, layout_name, device, seed)
    planes = kv_planes(kv, "strided" if layout_name in LAYOUT_ORDERS else layout_name)
    layout = planes.block_layout()
    nbytes = n * layout.block_bytes
    rng = np.random.default_rng(seed)
    blocks, slots = rng.permutation(2 * n)[:n], rng.permutation(n)
    prefix = f"kvsbench.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    pool_bytes = n * layout.slot_stride
    page = place_of(shm_dir).page_bytes
    segment_bytes = -(-pool_bytes // page) * page  # one segment: the floor copies it whole
    with (
        ShmPool.create(prefix, pool_bytes, directory=shm_dir, segment_bytes=segment_bytes) as pool,
        GpuBlockCopier(planes, pool, max_ctas=max_ctas) as copier,
    ):
        stream, lib, index = copier.stream, _lib.load(), device.index or 0
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = pool.segment_view(0).ctypes.data

        def floor(dst: int, src: int) -> Callable[..., None]:
            def copy(queued: Callable[[], None] | None = None) -> None:
                _lib.check(lib.kv_memcpy(index, dst, src, nbytes, stream.cuda_stream), "memcpy")
                if queued is not None:
                    queued()
                stream.synchronize()

            return copy

        fns = {
            "floor_d2h": floor(pinned, flat.data_ptr()),
            "floor_h2d": floor(flat.data_ptr(), pinned),
        }
        for path in PATHS:
            if path == "sm" and not copier.sm_capable:
                continue
            fns[f"{path}_d2h"] = _op(copier.save, blocks, slots, layout, path)
            fns[f"{path}_h2d"] = _op(copier.load, blocks, slots, layout, path)
        times = time_interleaved(fns, repeats)
        queued = _time_queued(fns, repeats, stream)
        busy, slowdown = _with_matmul(fns, times, repeats, device) if contention else ({}, {})
        _check_bytes(copier, planes, pool, blocks, slots, layout)
        result = {
            "layers": model.layers,
            "kv_heads": model.kv_heads,
            "head_dim": model.head_dim,
            "layout": layout_name,
            "blocks": n,
            "block_bytes": layout.block_bytes,
            "chunk_bytes": planes.chunk_bytes,
            "bytes": nbytes,
            "register_seconds": copier.register_seconds,
            "register_gbps": pool.nbytes / max(copier.register_seconds, 1e-9) / 1e9,
            "auto_path": copier.choose_path("auto"),
            "dma_kind": copier.dma_kind,
            "batch_error": copier.batch_error,
            "pool_dir": pool.directory or "/dev/shm",
            "pool_page_kind": pool.page_kind,
            "max_ctas": max_ctas,
        }
    for name, seconds in times.items():
        result[f"{name}_gbps"] = nbytes / statistics.median(seconds) / 1e9
    for name, seconds in queued.items():
        result[f"{name}_queued_gbps"] = nbytes / statistics.median(seconds) / 1e9
    for name, seconds in busy.items():
        result[f"{name}_matmul_gbps"] = nbytes / statistics.median(seconds) / 1e9
    for name, ratio in slowdown.items():
        result[f"{name}_matmul_slowdown"] = ratio
    for key in [k for k in result if k.endswith("_gbps") and k[:3] in ("sm_", "dma")]:
        direction = "d2h" if "_d2h" in key else "h2d"
        kind = next((k for k in ("_matmul", "_queued") if k in key), "")
        result[key.replace("_gbps", "_vs_floor")] = (
            result[key] / result[f"floor_{direction}{kind}_gbps"]
        )
    return result


def _engine_kv(model: Model, num_blocks: int, layout: str, device: Any, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    if layout in LAYOUT_ORDERS:
        from engine_shim.kvconnector.geometry import KVGeometry

        page = TOKENS_PER_BLOCK * model.kv_heads * 2 * model.head_dim
        geometry = KVGeometry(layout, num_layers=model.layers, block_size=TOKENS_PER_BLOCK,
                              num_kv_heads=model.kv_heads, head_dim=model.head_dim,
                              dtype=torch.bfloat16, block_elems=page)  # fmt: skip
        views = geometry.stand_in(num_blocks, device=device)
        for view in views:
            view.view(torch.uint8).random_(0, 256)
        return views
    chunk = (TOKENS_PER_BLOCK, model.kv_heads, model.head_dim)
    shape = {
        "vllm_flash": (2, num_blocks, *chunk),
        "flashinfer": (num_blocks, 2, *chunk),
        "cross_layer": (num_blocks, model.layers, 2, *chunk),
    }[layout]
    count = 1 if layout == "cross_layer" else model.layers
    kv = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(count)]
    for t in kv:
        t.view(torch.uint8).random_(0, 256)
    return kv[0] if layout == "cross_layer" else kv


def _op(method: Callable, blocks: np.ndarray, slots: np.ndarray, layout: Any, path: str):
    def copy(queued: Callable[[], None] | None = None) -> None:
        handle = method(blocks, slots, layout, 0, path=path)
        if queued is not None:
            queued()
        handle.synchronize()

    return copy


def _time_queued(
    fns: dict[str, Callable[..., None]], repeats: int, stream: Any
) -> dict[str, list[float]]:
    """Each fn's GPU seconds when it is queued behind other GPU work, as an
    engine queues a save behind its forward pass: the host's part of the op
    (checks, index upload, launches) then overlaps that work. A GPU sleep
    longer than any op's host part holds the current stream; the time runs
    from its end to the end of everything the fn queued on the copier's
    stream (the floor's copy runs there too)."""
    import torch

    times: dict[str, list[float]] = {name: [] for name in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            torch.cuda._sleep(QUEUED_SLEEP_CYCLES)
            start.record()
            stream.wait_event(start)  # the floor's copy too (copier ops wait by themselves)
            fn(lambda: end.record(stream))
            end.synchronize()
            if round_:
                times[name].append(start.elapsed_time(end) / 1e3)
    return times


def _with_matmul(
    fns: dict[str, Callable[[], None]], alone: dict[str, list[float]], repeats: int, device: Any
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each fn's seconds while a backlog of bf16 matmuls, queued first on
    another stream and long enough to outlast it, keeps the SMs busy; and
    how much each fn, called back to back, slows a fixed run of matmuls
    (matmul GPU time with it / alone; 1.0 = no interference)."""
    import torch

    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    mm_stream = torch.cuda.Stream(device)

    def matmuls(count: int) -> tuple[Any, Any]:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(mm_stream):
            begin.record(mm_stream)
            for _ in range(count):
                torch.matmul(a, a, out=out)
            end.record(mm_stream)
        return begin, end

    matmuls(1)
    begin, end = matmuls(5)
    end.synchronize()
    per_matmul = begin.elapsed_time(end) / 1e3 / 5
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            count = math.ceil(2 * statistics.median(alone[name]) / per_matmul) + 2
            matmuls(count)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            mm_stream.synchronize()
    count = max(8, math.ceil(0.05 / per_matmul))  # ~50 ms of matmuls
    slowdown: dict[str, float] = {}
    for name, fn in fns.items():
        ratios = []
        for _ in range(repeats):
            begin, end = matmuls(count)
            end.synchronize()
            quiet = begin.elapsed_time(end)
            begin, end = matmuls(count)
            while not end.query():
                fn()
            end.synchronize()
            ratios.append(begin.elapsed_time(end) / quiet)
        slowdown[name] = statistics.median(ratios)
    return times, slowdown


def _check_bytes(copier: Any, planes: Any, pool: Any, blocks: np.ndarray, slots: Any, layout: Any):
    """A benchmark that copies the wrong bytes measures nothing: check every
    path's save of the first blocks, and its load into zeroed blocks."""
    import torch

    sample_blocks, sample_slots = blocks[:4], slots[:4]
    want = [torch.stack([p[int(b)] for b in sample_blocks]).cpu() for p in planes.planes]
    for path in PATHS:
        if path == "sm" and not copier.sm_capable:
            continue
        copier.save(sample_blocks, sample_slots, layout, 0, path=path).synchronize()
        for i, slot in enumerate(sample_slots):
            view = pool.slot_view(int(slot), layout.slot_stride)
            for p, expect in enumerate(want):
                start = layout.offset(0, p)
                got = view[start : start + layout.layer_block_bytes]
                if not np.array_equal(got, expect[i].numpy()):
                    raise RuntimeError(f"{path} save: plane {p} of block {i} differs")
        for p in planes.planes:
            p[torch.as_tensor(sample_blocks, device=p.device)] = 0
        copier.load(sample_blocks, sample_slots, layout, 0, path=path).synchronize()
        for p, expect in zip(planes.planes, want, strict=True):
            if not torch.equal(torch.stack([p[int(b)] for b in sample_blocks]).cpu(), expect):
                raise RuntimeError(f"{path} load: bytes differ")


def _summary(cases: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from cuda_ext import _lib

    goals: dict[str, Target] = {}
    for name, case in cases.items():
        if case["blocks"] >= TARGET_BLOCKS:
            path = case["auto_path"]
            for d in ("d2h", "h2d"):
                rule = f"auto's path ({path}) / cudaMemcpy of pinned memory >= {TARGET_VS_FLOOR:g}"
                goals[f"{name}.{d}"] = at_least(case[f"{path}_{d}_vs_floor"], TARGET_VS_FLOOR, rule)
    return {
        "benchmark": "gpu",
        "skipped": False,
        "device": torch.cuda.get_device_name(),
        "cuda_runtime": _lib.runtime_version(),
        "cuda_driver": _lib.driver_version(),
        "layout": args.layout,
        "quick": bool(args.quick),
        "seed": args.seed,
        "target_vs_floor": TARGET_VS_FLOOR,
        "targets": goals,
        "cases": cases,
    }


def _rows(cases: dict[str, dict[str, Any]]) -> list[tuple]:
    rows = []
    for name, c in cases.items():
        for path in PATHS:
            for d in ("d2h", "h2d"):
                if f"{path}_{d}_gbps" not in c:
                    continue
                floor = c[f"floor_{d}_gbps"]
                busy = c.get(f"{path}_{d}_matmul_gbps", math.nan)
                busy_ratio = c.get(f"{path}_{d}_matmul_vs_floor", math.nan)
                gbps, ratio = c[f"{path}_{d}_gbps"], c[f"{path}_{d}_vs_floor"]
                queued = c[f"{path}_{d}_queued_vs_floor"]
                mib = c["bytes"] / (1 << 20)
                slow = c.get(f"{path}_{d}_matmul_slowdown", math.nan)
                rows.append(
                    (name, mib, path, d, gbps, floor, ratio, queued, busy, busy_ratio, slow)
                )
    return rows
