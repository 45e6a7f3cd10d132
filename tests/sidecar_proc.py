"""Real sidecar processes and real engine processes for the integration tests.

Every sidecar gets its own instance name and runtime directory, so tests
run in parallel under pytest-xdist without sharing a socket or shm name.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest

from sidecar.runtime import InstancePaths

ROOT = Path(__file__).resolve().parent.parent

# A small model: 2 layers of [num_blocks, K/V, tokens, heads, head_dim] fp32.
NUM_LAYERS = 2
TOKENS_PER_BLOCK = 16
BLOCK_SHAPE = (2, TOKENS_PER_BLOCK, 2, 8)
NUM_GPU_BLOCKS = 64
MODEL = {
    "model_name": "tiny",
    "model_revision": "r1",
    "tokens_per_block": TOKENS_PER_BLOCK,
    "num_kv_heads": 2,
    "head_dim": 8,
}


DEADLINE = 120.0
"""How long a test waits for something that must happen (a spawned engine
to start, a condition to hold) before it fails: long, because on a loaded
machine (pytest -n 2 beside other work) a spawned process importing torch
takes tens of seconds. A test that passes never waits it out."""


TMP_PREFIX = "kvs-t"
"""Every directory a test helper makes in /tmp is named TMP_PREFIX, the pid
of the process that made it, "-", then mkdtemp's random part: the leak guard
(conftest.py) tells this run's leftovers from those of other runs on the
machine by that pid."""


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `mnt` (made here) with mount `options` (e.g.
    "size=8m", "ro,size=1m") for the test's length; the test is skipped where
    mounting is not allowed. Unmounted lazily: a failed test may hold files."""
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def tmp_dir(kind: str = "") -> str:
    """A new private directory /tmp/kvs-t<pid>-<kind><random> (short: an ipc
    socket path in it stays well under the 107 bytes Linux takes). Whoever
    makes one removes it; the leak guard fails the run if one is left."""
    return tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{kind}", dir="/tmp")


UNCLEANED: list[Sidecar] = []
"""Sidecars made in this process whose `cleanup` has not run yet: the
autouse fixtures in conftest.py clean up those a test (or a module's
fixtures) made and left, even when it failed or never started them."""


class Sidecar:
    """`kvsidecar serve` in a subprocess, stopped (and checked clean) by `stop`.

    The default lease (5 s, a heartbeat every 1.7 s) is long compared with
    the scheduling delays of a loaded machine; a test about leases picks its own.

    Its runtime directory is a new one under /tmp (removed by `cleanup`)
    unless `runtime_dir` names one, which is then left to its owner; its
    instance name is a new one unless `instance` names one."""

    def __init__(
        self,
        *args: str,
        capacity: str = "4MiB",
        lease: float = 5.0,
        instance: str | None = None,
        runtime_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.instance = instance or f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._own_dir: str | None = None
        if runtime_dir is None:
            self._own_dir = self.runtime_dir = tmp_dir()
        else:
            self.runtime_dir = str(runtime_dir)
        UNCLEANED.append(self)
        self.args = [
            "--instance",
            self.instance,
            "--set",
            f"runtime_dir={self.runtime_dir}",
            "--cpu-capacity",
            capacity,
            "--set",
            f"lease_seconds={lease}",
            "--set",
            "drain_seconds=1",
            "--parent-pid",
            str(os.getpid()),
            *args,
        ]
        self.endpoint = f"ipc://{self.runtime_dir}/{self.instance}.sock"
        if "--endpoint" in args:
            self.endpoint = args[args.index("--endpoint") + 1]
        self.proc: subprocess.Popen[str] | None = None
        self._terminated = False
        self.banner = ""
        self.early: list[str] = []

    @property
    def shm_prefix(self) -> str:
        return InstancePaths(Path(self.runtime_dir), self.instance).shm_prefix

    def shm_segments(self) -> list[str]:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(self.shm_prefix + "."))

    def start(self, timeout: float = DEADLINE) -> Sidecar:
        """Start it and read its stderr (all its output) up to the "serving on"
        line: `banner`; the lines before it are kept in `early`."""
        self._terminated = False
        self.proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "kvsidecar", "serve", *self.args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        while (line := read_line(self.proc.stderr, deadline)) is not None:
            if "serving on" in line:
                self.banner = line
                return self
            self.early.append(line)
        code = self.proc.poll()
        err = self.proc.stderr.read() if code is not None else ""
        self.kill()
        how = f"exited with {code}" if code is not None else f"no banner in {timeout:.0f} s"
        raise RuntimeError(f"sidecar did not start ({how}): {''.join(self.early)}{err}")

    def terminate(self) -> None:
        """SIGTERM: the sidecar drains and exits (`stop` then only waits)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        self._terminated = True

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (unless `terminate` sent it) and wait; returns the exit
        code. A second SIGTERM could find the interpreter finalizing, with
        the default action back: a clean exit would read as -15."""
        assert self.proc is not None
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._close_pipes()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc is not None:
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()

    def cleanup(self) -> None:
        """Kill if still running and remove what a killed sidecar leaves
        behind: its shm segments, and the runtime directory if it made it
        (a directory it was given is its owner's). Safe to call again."""
        self.kill()
        from shm import hotindex
        from shm.pool import remove_stale_segments

        if self.proc is not None:
            remove_stale_segments(self.shm_prefix)
            hotindex.remove_stale(self.shm_prefix)
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        if self in UNCLEANED:
            UNCLEANED.remove(self)


@contextlib.contextmanager
def frozen(s: Sidecar) -> Iterator[None]:
    """The sidecar stopped (SIGSTOP) for the block's length: its sockets
    still accept connections (the kernel's backlog), but its loop runs
    nothing, so it does not make a removed lock file again meanwhile."""
    assert s.proc is not None
    s.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        s.proc.send_signal(signal.SIGCONT)


def read_line(pipe: IO[str], deadline: float) -> str | None:
    """The next line `pipe` (a child's text pipe, not read through its
    buffer yet) gives before `deadline`; None at its end or the deadline.

    Read a byte at a time from the descriptor: a buffered readline after
    select() may pull the following lines into the buffer, where select()
    no longer sees them. The pipe's own read() still works afterwards."""
    fd, line = pipe.fileno(), bytearray()
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], min(left, 0.5))[0]:
            continue
        byte = os.read(fd, 1)
        if not byte:
            return line.decode(errors="replace") or None
        line += byte
        if byte == b"\n":
            return line.decode(errors="replace")
    return None


SPAWN = multiprocessing.get_context("spawn")


def run(fn, *args):
    """`fn(*args)` in a fresh spawned process (an engine of its own)."""
    with SPAWN.Pool(1) as pool:
        return pool.apply(fn, args)


def stats_of(s: Sidecar) -> dict:
    from contract import protocol as p
    from engine_shim.channel import Channel

    channel = Channel(s.endpoint, 30.0)
    try:
        reply, _ = channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        return reply.stats
    finally:
        channel.close()


def wait_for(predicate, timeout: float = DEADLINE, interval: float = 0.05) -> None:
    """Poll `predicate` every `interval` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(interval)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m kvsidecar ARGS` from the repository root, run to its end
    (in `env`, None: this process's), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )


def make_kv(seed: int | None, num_blocks: int = NUM_GPU_BLOCKS) -> list:
    """The engine's paged KV cache: random values (seed) or zeros (None)."""
    import torch

    shape = (num_blocks, *BLOCK_SHAPE)
    if seed is None:
        return [torch.zeros(shape) for _ in range(NUM_LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(NUM_LAYERS)]


def tokens(n_blocks: int, start: int = 0, tail: int = 0) -> np.ndarray:
    """A prompt of n full blocks (+ a partial tail) with a recognisable pattern."""
    return np.arange(start, start + n_blocks * TOKENS_PER_BLOCK + tail, dtype=np.int64) % 30_000


def connect(
    endpoint: str, kv: list, *, timeout: float = 10.0, hot_path: bool = True, **register: object
):
    """A registered client; its calls wait up to `timeout` for the sidecar
    (long by default: a loaded machine may take seconds to answer).
    `hot_path=False`: every lookup and load asks the sidecar."""
    from engine_shim import KVClient

    client = KVClient.connect(endpoint, timeout=timeout, hot_path=hot_path)
    client.register(kv, **{**MODEL, **register})  # type: ignore[arg-type]
    return client


def shorten_timeout(client, timeout: float) -> None:
    """From now on the client's calls wait only `timeout` for a reply: for a
    test of a sidecar that stops answering, after a set-up whose calls must
    not time out on a loaded machine. (Its heartbeat keeps its own channel.)"""
    client.timeout = client._link.channel.timeout = timeout


# ---- engine processes (run under multiprocessing "spawn") ---------------------------


def save_worker(endpoint: str, seed: int, n_blocks: int, barrier=None) -> int:
    """An engine that saves n blocks of random KV (from `seed`) in blocks 0..n-1."""
    kv = make_kv(seed)
    client = connect(endpoint, kv)
    try:
        if barrier is not None:
            barrier.wait()
        return client.save(tokens(n_blocks), np.arange(n_blocks)).wait()
    finally:
        client.close()


def load_worker(endpoint: str, n_blocks: int, offset: int = 5) -> tuple[int, list[bytes]]:
    """An engine that loads the cached prefix into blocks offset.. of zeroed KV;
    returns tokens loaded and the bytes of those blocks, per layer."""
    kv = make_kv(None)
    client = connect(endpoint, kv)
    try:
        ids = np.arange(offset, offset + n_blocks)
        loaded = client.load(tokens(n_blocks), ids).wait()
        n = loaded // TOKENS_PER_BLOCK
        return loaded, [layer[offset : offset + n].numpy().tobytes() for layer in kv]
    finally:
        client.close()


def expected_blocks(seed: int, n_blocks: int) -> list[bytes]:
    return [layer[:n_blocks].numpy().tobytes() for layer in make_kv(seed)]


def hang_mid_save_worker(endpoint: str, n_blocks: int, conn) -> None:
    """Gets a save plan, copies nothing, tells the parent, then waits to be killed."""
    from contract import protocol as p
    from engine_shim.channel import Channel

    client = connect(endpoint, make_kv(1))
    keys = client._keys(tokens(n_blocks))
    channel = Channel(endpoint, 30.0)
    reply, _ = channel.call(
        p.Save(v=p.PROTOCOL_VERSION, id=0, session=client.session),
        [p.keys_frame(keys), p.ids_frame(np.arange(n_blocks))],
    )
    conn.send(reply.stored_blocks)
    time.sleep(60)


def idle_engine_worker(endpoint: str, conn) -> None:
    """Registers (its heartbeats renew its lease), tells the parent, then
    idles until killed."""
    client = connect(endpoint, make_kv(2))
    conn.send(client.session)
    time.sleep(60)


BIG_MODEL = {**MODEL, "num_kv_heads": 8, "head_dim": 128}
BIG_BLOCK_SHAPE = (2, TOKENS_PER_BLOCK, 8, 128)
"""256 KiB blocks (2 layers of 128 KiB): a 1 MiB CPU tier holds 4."""


def big_kv(value: float) -> list:
    import torch

    return [torch.full((16, *BIG_BLOCK_SHAPE), value) for _ in range(NUM_LAYERS)]


def freeze_mid_save_worker(endpoint: str, n_blocks: int, conn) -> None:
    """Saves n blocks of BIG_MODEL KV (all 1.0), but stops itself (SIGSTOP,
    as a VM pause or a cgroup freeze would) right before its copy into the
    plan's slots; once continued, copies and reports how the save ended."""
    from cuda_ext import copier

    copy = copier.CpuBlockCopier.save

    def frozen_then_copy(self, *args, **kwargs):
        conn.send("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)
        return copy(self, *args, **kwargs)

    copier.CpuBlockCopier.save = frozen_then_copy  # type: ignore[method-assign]
    client = connect(endpoint, big_kv(1.0), **BIG_MODEL)
    try:
        conn.send(client.save(tokens(n_blocks), np.arange(n_blocks)).wait())
    except Exception as err:
        conn.send(repr(err))


def tp_rank1_worker(endpoint: str, seed: int, inbox, outbox) -> str:
    """TP rank 1 of engine "tp": registers, then runs the plan its leader sends."""
    client = connect(endpoint, make_kv(seed), tp_size=2, tp_rank=1, engine_id="tp")
    try:
        outbox.put("registered")
        client.execute(inbox.get(timeout=DEADLINE)).wait()
        return "done"
    finally:
        client.close()


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port free now on 127.0.0.1, for a server a test starts later.

    Picked below the kernel's ephemeral range: bind(0) hands out an
    ephemeral port, which any outgoing connection (to Redis, to a sidecar)
    may take before the test's server binds it. Ports handed out before in
    this process are skipped; other test processes pick at random."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = max(low, 2048)
    picker = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = picker.randrange(1024 + low // 4, low)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port below {low}")


def local_sidecar_owner(workdir: str, conn) -> None:
    """Start a LocalSidecar, send (its pid, shm segments, socket path), then
    sleep until killed: an owner that dies without stopping its sidecar."""
    from engine_shim.local_sidecar import LocalSidecar

    local = LocalSidecar(Path(workdir), cpu_capacity="4MiB").start()
    assert local.proc is not None
    socket_path = local.endpoint.removeprefix("ipc://")
    conn.send((local.proc.pid, local.shm_segments(), socket_path))
    time.sleep(600)
