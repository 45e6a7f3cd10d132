"""A real `kvsidecar serve` subprocess for benchmarks.

It gets its own instance name and runtime directory (inside the caller's
work directory), so a benchmark never touches a sidecar someone is running,
and benchmarks run side by side. Its log goes to `sidecar.log` in the work
directory, never to a pipe nobody reads.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from shm.names import SHM_DIR, remove_stale_segments


class SidecarProcess:
    def __init__(self, workdir: Path, *, capacity: str, lease_seconds: float = 60.0) -> None:
        self.instance = f"bench{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.runtime_dir = workdir / "run"
        self.log_path = workdir / "sidecar.log"
        self.endpoint = f"ipc://{self.runtime_dir}/{self.instance}.sock"
        self.args = [
            "--instance",
            self.instance,
            "--set",
            f"runtime_dir={self.runtime_dir}",
            "--cpu-capacity",
            capacity,
            "--set",
            f"lease_seconds={lease_seconds}",
            "--set",
            "drain_seconds=1",
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.banner = ""

    @property
    def shm_prefix(self) -> str:
        return f"kvsidecar.{os.getuid()}.{self.instance}"

    def shm_segments(self) -> list[str]:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(self.shm_prefix + "."))

    def start(self, timeout: float = 60.0) -> SidecarProcess:
        """Start it and wait for its "serving on" line; RuntimeError if it does not come."""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "serve", *self.args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                self.banner = self.proc.stdout.readline()
                if "serving on" in self.banner:
                    return self
        self.kill()
        raise RuntimeError(f"the sidecar did not start: {self.banner!r} {self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait; the exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def remove_leftovers(self) -> list[str]:
        """Remove the shm segments a dead or broken sidecar left; returns their names."""
        return remove_stale_segments(self.shm_prefix)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-2000:]
        except OSError:
            return ""
