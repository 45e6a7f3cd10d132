"""tools/offline-gpu: the scripts that carry the GPU checks to a machine with
no package index parse, and refuse what they do not know before doing
anything. (What they pack and run is checked where a GPU is lent:
docs/gpu.md, "On a GPU machine with no package index".)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "offline-gpu"


@pytest.mark.parametrize("script", ["bundle.sh", "run.sh"])
def test_the_scripts_parse(script):
    subprocess.run(["bash", "-n", str(TOOLS / script)], check=True)


@pytest.mark.parametrize(
    ("args", "says"),
    [([], "usage"), (["gpu"], "usage"), (["base", "tset"], "unknown step 'tset'")],
)
def test_run_refuses_what_it_does_not_know(tmp_path, args, says):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(TOOLS / "run.sh"), *args],
        env={"PATH": "/usr/bin:/bin", "OUT": str(out)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert says in done.stderr
    assert not out.exists()
