"""What the package ships and needs: py.typed markers and the C extensions'
.pyi stubs are package data; matplotlib is only in the `analyze` (and `test`)
extra, and neither the daemon nor the CLI imports it until a plot is drawn."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sidecar_proc import ROOT

PACKAGES = ("contract", "shm", "sidecar", "cuda_ext", "engine_shim", "cachesim", "router")
PACKAGES += ("bench", "kvsidecar")
STUBS = ("contract/_blake2chain.pyi", "sidecar/control/_nodeheap.pyi", "shm/_hotindex.pyi")


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_package_is_marked_typed_in_the_source() -> None:
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
    for stub in STUBS:
        assert (ROOT / stub).is_file(), stub


def test_a_build_ships_the_markers_the_stubs_and_the_trace(tmp_path: Path) -> None:
    """setuptools' build_py (what a wheel holds, less the compiled extensions)
    on a copy of the work tree, so the tree itself is untouched."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    src = tmp_path / "src"
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path / "lib"
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for package in PACKAGES:
        assert (out / package / "py.typed").is_file(), package
    for stub in STUBS:
        assert (out / stub).is_file(), stub
    assert (out / "cachesim/traces/mooncake_conversation_trace.jsonl").is_file()
    assert not (out / "tests").exists()


def test_matplotlib_is_an_extra_not_a_dependency() -> None:
    project = _project()
    assert not [d for d in project["dependencies"] if d.lower().startswith("matplotlib")]
    extras = project["optional-dependencies"]
    for extra in ("analyze", "test"):
        assert [d for d in extras[extra] if d.startswith("matplotlib")], extra


def test_the_daemon_and_the_cli_do_not_import_matplotlib() -> None:
    _imports_without(
        "matplotlib",
        "import kvsidecar.cli, sidecar.server.server, cachesim.analyze\n"
        "kvsidecar.cli.build_parser()\n",
    )


def test_the_daemon_starts_without_torch() -> None:
    """`kvsidecar serve` parses its command line and builds its server
    without importing torch (the benchmarks' modules, which do, are left out)."""
    _imports_without(
        "torch",
        "import kvsidecar.cli, sidecar.server.server\nkvsidecar.cli.build_parser('serve')\n",
    )


def _imports_without(module: str, code: str) -> None:
    """`code`, run in a fresh interpreter, leaves `module` unimported."""
    code = f"import sys\n{code}assert {module!r} not in sys.modules, 'imported'\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_analyze_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    """--png with matplotlib missing is refused before any work, naming the extra."""
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if it were not installed\n"
        "from kvsidecar.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    trace = ROOT / "cachesim/traces/mooncake_conversation_trace.jsonl"
    png = tmp_path / "p.png"
    done = subprocess.run(
        [sys.executable, "-c", code, "analyze", str(trace), "--png", str(png)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'kvsidecar[analyze]'" in done.stderr
    assert "Traceback" not in done.stderr and not png.exists()


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["analyze", "--help"]])
def test_help_runs(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvsidecar", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
