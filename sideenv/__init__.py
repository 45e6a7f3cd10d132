"""Side virtual environments: engines and peers kept out of the project's own.

A benchmark or test that needs vLLM, SGLang, a peer cache (AIBrix, LMCache) or
libCacheSim runs it in a virtual environment of its own, under the user's
cache directory (`$XDG_CACHE_HOME` or `~/.cache`, then
`kvsidecar/side-envs/<name>`), installed on first use at pinned versions and
printed as it goes. The project's environment keeps its CPU torch.

An environment is ready when its marker file holds exactly the install steps
it was built from; changed steps rebuild it from scratch. Two processes that
want one environment at once (pytest-xdist workers) take a file lock, so one
installs and the other waits and reuses it.

`python -m sideenv ensure NAME` installs one; `python -m sideenv run NAME --
COMMAND...` runs a command in it with the project's root on PYTHONPATH.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MARKER = "kvsidecar-side-env.json"
ROOT = Path(__file__).resolve().parent.parent
"""The project's root: what `run` puts on PYTHONPATH."""


class SideEnvError(RuntimeError):
    """A side environment could not be built."""


@dataclass(frozen=True)
class SideEnv:
    """A named environment and the pip installs that build it, in order."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    """Each step is the argument list of one `pip install`."""
    purpose: str = ""

    def marker(self) -> str:
        return json.dumps({"name": self.name, "steps": [list(s) for s in self.steps]})


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvsidecar" / "side-envs"


def location(env: SideEnv, root: Path | None = None) -> Path:
    return (root or cache_root()) / env.name


def python_of(env: SideEnv, root: Path | None = None) -> Path | None:
    """The environment's interpreter when it is fully installed, else None."""
    where = location(env, root)
    python, marker = where / "bin" / "python", where / MARKER
    if python.is_file() and marker.is_file() and marker.read_text().strip() == env.marker():
        return python
    return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure(
    env: SideEnv,
    root: Path | None = None,
    base_python: str = sys.executable,
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> Path:
    """The environment's interpreter, installing it first if needed."""
    python = python_of(env, root)
    if python is not None:
        return python
    where = location(env, root)
    with _locked(where.with_name(where.name + ".lock")):
        python = python_of(env, root)  # built by another process meanwhile
        if python is not None:
            return python
        log(f"installing the {env.name} side environment into {where} (first use)")
        shutil.rmtree(where, ignore_errors=True)
        _run([base_python, "-m", "venv", str(where)], env, log)
        pip = [str(where / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
        for step in env.steps:
            log(f"  pip install {' '.join(step)}")
            _run([*pip, *step], env, log)
        (where / MARKER).write_text(env.marker() + "\n")
    return where / "bin" / "python"


def _run(command: list[str], env: SideEnv, log: Callable[[str], None]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("Successfully"):
            log(f"    {line}")
    if done.returncode:
        raise SideEnvError(
            f"could not build the {env.name} side environment ({' '.join(command[:5])} ...):\n"
            f"{done.stderr.strip()[-2000:]}"
        )


def run_in(env: SideEnv, command: list[str], root: Path | None = None) -> int:
    """Run `command` (its first word resolved in the environment's bin/ when
    there) with the project's root on PYTHONPATH; its exit status."""
    python = ensure(env, root)
    bin_dir = python.parent
    first = bin_dir / command[0]
    argv = [str(first) if first.exists() else command[0], *command[1:]]
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p
    )
    environ["PATH"] = os.pathsep.join((str(bin_dir), environ.get("PATH", "")))
    environ["VIRTUAL_ENV"] = str(python.parent.parent)
    return subprocess.run(argv, env=environ, cwd=ROOT).returncode
