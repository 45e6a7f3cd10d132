"""`kvsidecar bench ssd`: the SSD tier's read and write GB/s against raw O_DIRECT.

Cases: batches of 16 and 256 blocks of 2 MiB and of 256 KiB (`256x2048k`).
Every figure has its floor from the same run, in the same directory:
- tier: SsdStore.write_run / read_run as the sidecar drives them (`bench.ssd_io`):
  an IoPool of the sidecar's default `ssd_io_threads`, each batch split into
  parts across the threads as the data plane splits an op, blocks moving
  between the page-aligned slots of a real, prefaulted ShmPool and the tier's
  data file; journal records and xxh3 checksums included;
- floor: parallel O_DIRECT writes and reads of the same blocks,
  same threads and split, same slots, into the tier's own data file at the
  offsets the tier uses (the same bytes, so the tier's records stay true),
  issued as the tier issues them: a thread's writes `write_depth` blocks at
  a time through Linux AIO (`sidecar.tiers.ssd.store.WRITE_BYTES` in
  flight), reads one `preadv` a block. Beside it, writes one synchronous
  `pwritev` a block (`floor_per_block_write_gbps`,
  `write_vs_per_block_floor`: reported, no target), the floor before the
  tier's writes went through AIO; `write_depth`: the writes a thread has in
  flight per block size (null: no AIO, one at a time).
  Not a second file: two files of one directory sit in different places of
  the disk, and on these virtio disks that alone moved a run's floor by
  -16% to +7% against the other file, the same way in every round of that
  run (docs/measurements.md#ssd).
Each round writes every case (tier and floor, alternating which goes
first), drops the page cache when permitted (root), then reads every case;
a first round is untimed (it also turns the files' preallocated extents
into written ones). Every read, the tier's and the floor's, goes into
destination slots zeroed just before it, and its blocks are compared with
the ones written right after it (both untimed): a read that moves the
wrong bytes, or none, is an error. Both are measured with the pool on 4 KiB
pages (POSIX shm) and on huge pages: a temporary tmpfs mounted huge=always
(root only, unmounted after), or --huge-dir. `runs/2MiB` is how many physically
contiguous runs of pages a 2 MiB block of the pool spans (root only): on a
virtio disk, O_DIRECT into 4 KiB pages slows down as it grows.
- end to end (`bench.ssd_e2e`): a real `kvsidecar serve`, restarted so that
  its CPU tier is empty and its SSD index recovered; one GET of the largest
  batch of each block size, SSD -> shm -> engine tensors, against raw
  O_DIRECT reads, taken next to it, of the sidecar's own data file into its
  own CPU-tier memory.
- fio's sequential O_DIRECT figures (psync, one job per thread, its own
  buffers) when fio is on PATH.
GB/s are 1e9 bytes per second, medians over --repeats. A ratio to the floor
is the median of the ratios of sample pairs (tier and floor timed one after
the other, so the disk's drift cancels). Target: every ratio >= 0.8
(`targets` in the JSON, one per figure).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.hugepages import HugePagesUnavailable, physical_runs, thp_tmpfs
from bench.ssd_e2e import check_block_bytes, measure_get
from bench.ssd_io import Floor, Tier, drop_page_cache, fio_rates, key, run_batch
from bench.ssd_report import TARGET_VS_FLOOR, case_name, figures, print_report, targets
from cachesim.report import positive_int_list, write_json
from shm.pages import statfs
from shm.pool import ShmPool
from sidecar.config import Config
from sidecar.tiers.io_pool import IoPool
from sidecar.tiers.ssd.store import checksum

BLOCK_KIB = [2048, 256]
COUNTS = [16, 256]
QUICK_COUNTS = [16]
HUGE = 2 << 20
SAMPLE_BYTES = 256 << 20
QUICK_SAMPLE_BYTES = 64 << 20  # --quick, for the test suite: as before
WHO = {"write": ("tier", "floor", "floor_per_block"), "read": ("tier", "floor")}
"""What each phase times, in the order of even rounds (odd rounds reverse it,
and so does every other sample: the tier and its floor stay side by side)."""
FS_NAMES = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x01021994: "tmpfs"}


def filesystem_of(directory: str | Path) -> str:
    """The type of the filesystem `directory` is on ("ext4", "tmpfs", ...)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        magic = statfs(fd)[0]
    finally:
        os.close(fd)
    return FS_NAMES.get(magic, hex(magic))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ssd",
        help="SSD tier read/write GB/s and an end-to-end GET from SSD, against raw O_DIRECT",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", help="directory to measure in (default: a temp dir under /tmp)")
    p.add_argument(
        "--block-kib", type=positive_int_list, default=None, help="block sizes (2048,256)"
    )
    p.add_argument("--counts", type=positive_int_list, default=None, help="batch sizes (16,256)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (5; 1 with --quick)")
    p.add_argument("--threads", type=int, default=None, help="I/O threads (ssd_io_threads: 4)")
    p.add_argument("--huge-dir", help="an existing hugetlbfs or huge=always tmpfs for the pool")
    p.add_argument("--no-huge", action="store_true", help="skip the huge-page pool")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end GET")
    p.add_argument("--quick", action="store_true", help="small batches, for the test suite")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    threads = args.threads or Config().ssd_io_threads
    kibs = args.block_kib or BLOCK_KIB
    counts = args.counts or (QUICK_COUNTS if args.quick else COUNTS)
    repeats = args.repeats or (1 if args.quick else 5)
    if threads < 1 or repeats < 1 or any(k % 4 for k in kibs):
        print("threads and repeats must be >= 1, block sizes whole 4 KiB pages", file=sys.stderr)
        return 2
    e2e_kibs = [] if args.no_e2e else ([min(kibs)] if args.quick else kibs)
    try:
        for kib in e2e_kibs:
            check_block_bytes(kib << 10)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    parent = args.dir or "/tmp"
    base = Path(tempfile.mkdtemp(prefix="kvsbench-ssd-", dir=parent))
    try:
        result = _measure(args, base, kibs, counts, threads, repeats, e2e_kibs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result.update(threads=threads, repeats=repeats, quick=bool(args.quick), dir=parent)
    result["targets"] = targets(result)
    print_report(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _measure(
    args: argparse.Namespace,
    base: Path,
    kibs: list[int],
    counts: list[int],
    threads: int,
    repeats: int,
    e2e_kibs: list[int],
) -> dict[str, Any]:
    result: dict[str, Any] = {"filesystem": filesystem_of(base)}
    with contextlib.ExitStack() as stack:
        nbytes = -(-_regions(kibs, max(counts))[1] // HUGE) * HUGE  # one segment, in any fs
        pools, result["pools"] = _pools(stack, nbytes, args, base)
        budget = QUICK_SAMPLE_BYTES if args.quick else SAMPLE_BYTES
        result.update(_measure_io(base, pools, kibs, counts, threads, repeats, budget))
    result["fio"] = {
        case_name(n, kib): fio_rates(base / f"tier-{kib}k" / "kvsb.data", kib << 10, n, threads)
        for kib in kibs
        for n in counts
    }
    result["e2e"] = {}
    for kib in e2e_kibs:
        n = max(counts)
        print(f"end to end: {n} blocks of {kib} KiB ...", file=sys.stderr, flush=True)
        # The sidecar's socket and log in a short path (a socket path is at
        # most 107 bytes); its SSD directory in the directory measured.
        run_dir = Path(tempfile.mkdtemp(prefix="kvsbench-e2e-", dir="/tmp"))
        try:
            got = measure_get(run_dir, base / f"e2e-{kib}k", kib << 10, n, min(repeats, 3), threads)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        case = case_name(n, kib)
        got["tier_read_gbps"] = result["read_gbps"]["4k"][case]
        got["table_floor_read_gbps"] = result["floor_read_gbps"]["4k"][case]
        result["e2e"][case] = got
    result["target_vs_floor"] = TARGET_VS_FLOOR
    return result


def _pools(
    stack: contextlib.ExitStack, nbytes: int, args: argparse.Namespace, base: Path
) -> tuple[dict[str, ShmPool], dict[str, Any]]:
    """The 4 KiB-page pool, and a huge-page one when it can be had (a mount
    inside `base`, unmounted when `stack` closes)."""
    prefix = f"kvsbench.{os.getpid()}.ssd"
    pools = {"4k": stack.enter_context(ShmPool.create(prefix + "4k", nbytes, segment_bytes=nbytes))}
    about: dict[str, Any] = {"4k": _about(pools["4k"], "POSIX shm")}
    if args.no_huge:
        about["huge"] = {"skipped": "--no-huge"}
        return pools, about
    try:
        if args.huge_dir:
            where, how = args.huge_dir, f"--huge-dir {args.huge_dir}"
        else:
            where = stack.enter_context(thp_tmpfs(nbytes, parent=str(base)))
            how = "a temporary tmpfs mounted huge=always"
        huge = ShmPool.create(prefix + "huge", nbytes, directory=where, segment_bytes=nbytes)
        pool = stack.enter_context(huge)
    except (HugePagesUnavailable, OSError, RuntimeError, ValueError) as err:
        about["huge"] = {"skipped": str(err)}
        return pools, about
    pools["huge"] = pool
    about["huge"] = _about(pool, how)
    return pools, about


def _about(pool: ShmPool, how: str) -> dict[str, Any]:
    return {
        "how": how,
        "page_kind": pool.page_kind,
        "phys_runs_per_2mib": physical_runs(pool, 2 << 20, range(pool.num_slots(2 << 20))),
        "huge_bytes": pool.pages.huge_bytes,
        "bytes": pool.nbytes,
        "prefault_gbps": pool.nbytes / pool.prefault_seconds / 1e9,
    }


def _measure_io(
    base: Path,
    pools: dict[str, ShmPool],
    kibs: list[int],
    counts: list[int],
    threads: int,
    repeats: int,
    budget: int,
) -> dict[str, Any]:
    nmax = max(counts)
    cases = [(n, kib) for kib in kibs for n in counts]
    times: dict[tuple, list[float]] = {}
    dropped = []
    io = IoPool("bench", threads)
    stores = {
        kib: {
            "tier": Tier(base / f"tier-{kib}k", kib << 10, nmax),
        }
        for kib in kibs
    }
    for pair in stores.values():
        tier = pair["tier"]
        pair["floor"] = Floor(tier.data_path, tier.slot_bytes, nmax, depth=tier.depth)
        pair["floor_per_block"] = Floor(tier.data_path, tier.slot_bytes, nmax)
    try:
        with _slots(pools, kibs, nmax) as slots:
            for round_ in range(repeats + 1):
                label = f"round {round_}/{repeats}" if round_ else "warm-up round"
                print(f"{label}: {len(cases)} cases ...", file=sys.stderr, flush=True)
                for phase in ("write", "read"):
                    if phase == "read" and round_:
                        dropped.append(drop_page_cache())
                    order = WHO[phase][:: -1 if round_ % 2 else 1]
                    for (n, kib), kind in itertools.product(cases, pools):
                        src, dst = slots[kind][kib]
                        for j in range(_samples(n, kib, budget)):
                            for who in order if j % 2 == 0 else order[::-1]:
                                what = f"{who} {phase}, {n} x {kib} KiB, {kind} pool"
                                took = _timed(io, stores[kib][who], phase, n, src, dst, what)
                                if round_:
                                    times.setdefault((kind, n, kib, who, phase), []).append(took)
            sums = {kib: _checksum_gbps(slots["4k"][kib][0]) for kib in kibs}
    finally:
        io.close()
        for pair in stores.values():
            for t in pair.values():
                t.close()
    out = figures(times, pools, cases)
    out["write_depth"] = {f"{kib}k": pair["floor"].depth for kib, pair in stores.items()}
    out.update(
        page_cache_dropped=all(dropped),
        direct_io=all(t["tier"].direct for t in stores.values()),
        checksum_gbps={f"{kib}k": v for kib, v in sums.items()},
        cases={case_name(n, kib): {"blocks": n, "block_bytes": kib << 10} for n, kib in cases},
    )
    return out


def _timed(
    io: IoPool,
    store: Tier | Floor,
    phase: str,
    n: int,
    src: list[memoryview],
    dst: list[memoryview],
    what: str,
) -> float:
    """Seconds of one batch of `store` writing src or reading into dst. A read
    goes into slots zeroed before it and is checked after it (both untimed)."""
    if phase == "write":
        job = store.writer(src)
    else:
        _clear(dst[:n])
        job = store.reader(dst)
    start = time.perf_counter()
    run_batch(io, n, job)
    took = time.perf_counter() - start
    if phase == "read":
        _check(src[:n], dst[:n], what)
    return took


def _samples(n: int, kib: int, budget: int) -> int:
    """Timings of a case per round: up to 8, `budget` bytes in all (256 MiB
    by default: a batch of 256 x 256 KiB four times; 64 MiB with --quick).
    One sample a round left a ratio at the mercy of the disk's drift: the
    floor timed against itself read 0.90-1.13."""
    return max(1, min(8, budget // (n * (kib << 10))))


def _regions(kibs: list[int], nmax: int) -> tuple[dict[int, int], int]:
    """For `_slots`: each block size's first slot (at its own stride) in a
    single-segment pool, 2 * nmax slots each, disjoint; and the bytes needed."""
    firsts, offset = {}, 0
    for kib in kibs:
        stride = kib << 10
        firsts[kib] = -(-offset // stride)
        offset = (firsts[kib] + 2 * nmax) * stride
    return firsts, offset


@contextlib.contextmanager
def _slots(
    pools: dict[str, ShmPool], kibs: list[int], nmax: int
) -> Iterator[dict[str, dict[int, tuple[list[memoryview], list[memoryview]]]]]:
    """Per pool and block size, in a region of its own: nmax source slots
    (the same bytes in every pool) and nmax destination slots after them.
    The views go on exit, so the pools can then be unmapped."""
    pattern = np.random.default_rng(0).integers(0, 256, max(kibs) << 10, dtype=np.uint8)
    firsts, _ = _regions(kibs, nmax)
    slots: dict[str, dict[int, tuple[list[memoryview], list[memoryview]]]] = {}
    for kind, pool in pools.items():
        slots[kind] = {}
        for kib, first in firsts.items():
            stride = kib << 10
            views = [memoryview(pool.slot_view(first + i, stride)) for i in range(2 * nmax)]
            for i, view in enumerate(views[:nmax]):
                _fill(view, pattern[:stride], i)
            slots[kind][kib] = (views[:nmax], views[nmax:])
    try:
        yield slots
    finally:
        for by_kib in slots.values():
            for src, dst in by_kib.values():
                for view in src + dst:
                    view.release()
        slots.clear()


def _fill(view: memoryview, pattern: np.ndarray, i: int) -> None:
    """The pattern, stamped with the block's number."""
    block = np.frombuffer(view, dtype=np.uint8)
    block[:] = pattern
    block[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)


def _clear(dst: list[memoryview]) -> None:
    """Zero the destination slots before a read (untimed), so that a read
    which leaves them alone cannot pass for the one before it."""
    for view in dst:
        np.frombuffer(view, np.uint8)[:] = 0


def _check(src: list[memoryview], dst: list[memoryview], what: str) -> None:
    """A benchmark that moves the wrong bytes measures nothing: every block a
    read brought back must be the block written."""
    for i, (a, b) in enumerate(zip(src, dst, strict=True)):
        if not np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)):
            raise RuntimeError(f"block {i} read back wrong ({what}): the benchmark is broken")


def _checksum_gbps(src: list[memoryview]) -> float:
    """One thread's xxh3 rate over the blocks, as a read checks them."""
    start = time.perf_counter()
    for i, view in enumerate(src):
        checksum(view, key(i))
    return sum(len(v) for v in src) / (time.perf_counter() - start) / 1e9
