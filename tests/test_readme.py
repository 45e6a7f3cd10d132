"""The README's engine example runs as written against a real sidecar."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from sidecar_proc import Sidecar

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_engine_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 1
    sidecar = Sidecar(capacity="8MiB").start()
    try:
        env = {
            **os.environ,
            "KVSIDECAR_INSTANCE": sidecar.instance,
            "KVSIDECAR_RUNTIME_DIR": sidecar.runtime_dir,
        }
        done = subprocess.run(
            [sys.executable, "-c", blocks[0]], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["0", "96", "0.5"]
        assert sidecar.stop() == 0
    finally:
        sidecar.cleanup()
