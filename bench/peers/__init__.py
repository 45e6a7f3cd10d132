"""The systems behind `bench control`'s per-call rows, each in a process of its own.

`run_worker` starts one system's worker (`bench/peers/<name>_worker.py`,
protocol in `bench/peers/calls.py`): kvsidecar and the memcpy floor in the
project's interpreter, the peers in their side environments (sideenv/specs.py,
installed on first use; `--no-peers` skips them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from bench.peers.calls import Spec
from sideenv import ROOT, SideEnvError, ensure
from sideenv.specs import AIBRIX, LMCACHE, SideEnv

SYSTEMS: dict[str, SideEnv | None] = {
    "memcpy": None,
    "kvsidecar": None,
    "aibrix": AIBRIX,
    "lmcache": LMCACHE,
}
"""Every system, and the side environment it runs in (None: the project's)."""
PEERS = ("aibrix", "lmcache")


@dataclass(frozen=True)
class WorkerResult:
    """One system's rows, or why there are none."""

    version: str
    rows: dict[str, dict[str, float]]
    notes: str = ""
    error: str = ""
    """Why the system gave no rows (its side environment or its run failed)."""


def run_worker(name: str, spec: Spec, timeout: float = 3600.0) -> WorkerResult:
    """Run system `name`'s worker on `spec`; its result, or one with `error` set."""
    env = SYSTEMS[name]
    try:
        python = sys.executable if env is None else str(ensure(env))
    except SideEnvError as exc:
        return WorkerResult("", {}, error=str(exc))
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p
    )
    try:
        done = subprocess.run(
            [python, "-m", f"bench.peers.{name}_worker"],
            input=spec.to_json(),
            capture_output=True,
            text=True,
            env=environ,
            cwd=ROOT,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return WorkerResult("", {}, error=f"the {name} worker took over {timeout:.0f} s")
    for line in done.stderr.splitlines():
        if line.startswith(f"{name}:"):
            print(line, file=sys.stderr, flush=True)
    if done.returncode:
        tail = done.stderr.strip()[-3000:]
        return WorkerResult("", {}, error=f"the {name} worker exited {done.returncode}:\n{tail}")
    out: dict[str, Any] = json.loads(done.stdout)
    return WorkerResult(out["version"], out["rows"], out.get("notes", ""))
