"""`LocalSidecar`: a private `kvsidecar serve` subprocess, for the demo and
the benchmarks that need one sidecar of their own.

It never outlives the process that starts it: it runs with `--parent-pid`,
so if that process dies without stopping it (SIGKILL, a crash), the sidecar
drains and cleans up by itself within about a second.

It gets its own instance name and runtime directory inside the caller's work
directory (or, when a socket path there would pass the 107 bytes an ipc
path may have, a private directory under /tmp, removed by `close`), so it
never touches a sidecar someone else runs. Its output (all on stderr: the
start-up line, then its log) goes to `sidecar.log` in the work directory.
`stop()` stops it with SIGTERM (the sidecar then removes its shm segments,
socket and lock) and reports what, if anything, it left in /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from contract.endpoint import InstancePaths
from shm import hotindex
from shm.names import SHM_DIR, remove_stale_segments

IPC_PATH_MAX = 107
"""Bytes of an ipc:// socket path Linux takes (sockaddr_un.sun_path, NUL ended)."""

BENCH_SIDECAR_SETTINGS = {"lease_seconds": 60.0, "drain_seconds": 1}
"""For benchmarks: a client busy measuring is never dropped; a stop is quick."""


class Shutdown(NamedTuple):
    exit_code: int | None
    """The sidecar's exit status; None if it had to be killed."""
    leftovers: list[str]
    """shm segments it left behind (now removed); [] after a clean stop."""


class LocalSidecar:
    def __init__(
        self,
        workdir: Path,
        *,
        cpu_capacity: str,
        settings: Mapping[str, object] | None = None,
        tag: str = "local",
    ) -> None:
        """`settings`: configuration keys passed as `--set key=value`."""
        self.instance = f"{tag}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.runtime_dir = Path(workdir) / "run"
        self._own_dir: Path | None = None
        if len(os.fsencode(f"{self.runtime_dir}/{self.instance}.sock")) > IPC_PATH_MAX:
            self._own_dir = self.runtime_dir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
        self.log_path = Path(workdir) / "sidecar.log"
        self.endpoint = f"ipc://{self.runtime_dir}/{self.instance}.sock"
        self.args = ["--instance", self.instance, "--cpu-capacity", cpu_capacity]
        self.args += ["--parent-pid", str(os.getpid())]  # it never outlives this process
        for key, value in {"runtime_dir": self.runtime_dir, **(settings or {})}.items():
            self.args += ["--set", f"{key}={value}"]
        self.proc: subprocess.Popen[str] | None = None
        self.banner = ""

    @property
    def shm_prefix(self) -> str:
        return InstancePaths(self.runtime_dir, self.instance).shm_prefix

    def shm_segments(self) -> list[str]:
        """Its segments in /dev/shm: the CPU tier's and the hot indexes."""
        heads = (self.shm_prefix + ".", self.shm_prefix + "-hot.")
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(heads))

    def start(self, timeout: float = 60.0) -> LocalSidecar:
        """Start it and wait for its "serving on" line in its log (its stderr);
        RuntimeError if it does not come."""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvsidecar", "serve", *self.args],
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            banner = next((ln for ln in self.log_lines() if "serving on" in ln), None)
            if banner is not None:
                self.banner = banner
                return self
            time.sleep(0.05)
        shutdown = self.close()
        raise RuntimeError(
            f"the sidecar did not start (exit {shutdown.exit_code}): {self.log_tail()}"
        )

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait; the exit code (None if it had to be killed).
        The instance can be started again: same name, same runtime directory."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def remove_leftovers(self) -> list[str]:
        """Remove the shm segments a dead or broken sidecar left (the CPU
        tier's and its hot indexes); their names."""
        return remove_stale_segments(self.shm_prefix) + hotindex.remove_stale(self.shm_prefix)

    def close(self, timeout: float = 15.0) -> Shutdown:
        """`stop`, then remove whatever it left in /dev/shm (and its runtime
        directory, if it is one of its own under /tmp)."""
        shutdown = Shutdown(self.stop(timeout), self.remove_leftovers())
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        return shutdown

    def log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text().splitlines()
        except OSError:
            return []

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-2000:]
        except OSError:
            return ""
