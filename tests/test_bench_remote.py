"""`kvsidecar bench remote --quick` end to end, through the CLI, on a private server."""

from __future__ import annotations

import json
import math
import os

from redis_servers import ensure_redis
from shm_helpers import shm_entries
from sidecar_proc import free_port

from kvsidecar.cli import main


def test_remote_cli_quick_writes_figures_and_cleans_up(tmp_path):
    ensure_redis()
    out = tmp_path / "remote.json"
    args = ["bench", "remote", "--quick", "--threads", "2", "--write-streams", "3"]
    assert main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["threads"] == 2 and data["write_streams"] == 2  # capped by the threads
    for key in ("write_vs_floor", "read_vs_floor"):
        assert sorted(data[key]) == ["2048KiB", "256KiB"], key
        assert all(math.isfinite(v) and v > 0 for v in data[key].values()), key
    case = data["cases"]["256KiB"]
    assert case["block_bytes"] == 256 << 10 and case["blocks"] == 16
    for key in ("tier_write_gbps", "tier_read_gbps", "floor_write_gbps", "floor_read_gbps"):
        assert math.isfinite(case[key]) and case[key] > 0, key
    # Each floor is the fastest raw client of the same work, the plain-socket one included.
    writes = ("hiredis_packer", "python_packer", "raw")
    assert case["floor_write_gbps"] == max(case[f"floor_write_{k}_gbps"] for k in writes)
    assert case["floor_write_gbps"] == case[f"{case['floor_write_kind']}_gbps"]
    assert case["floor_read_gbps"] == max(case[f"floor_read_{k}_gbps"] for k in ("redis_py", "raw"))
    assert case["floor_read_gbps"] == case[f"{case['floor_read_kind']}_gbps"]
    assert case["read_vs_floor"] == case["tier_read_gbps"] / case["floor_read_gbps"]
    assert case["read_vs_redis_py"] == case["tier_read_gbps"] / case["floor_read_redis_py_gbps"]
    targets = {name: (t["value"], t["limit"]) for name, t in data["targets"].items()}
    assert targets == {
        f"{phase}.{case}": (data[f"{phase}_vs_floor"][case], 0.8)
        for phase in ("write", "read")
        for case in ("2048KiB", "256KiB")
    }
    assert all(t["within"] is (t["value"] >= 0.8) for t in data["targets"].values())
    assert shm_entries(f"kvsbench.{os.getpid()}.") == []


def test_remote_cli_reports_an_unreachable_server_and_bad_arguments(capsys):
    url = f"redis://127.0.0.1:{free_port()}"
    assert main(["bench", "remote", "--quick", "--url", url]) == 2
    assert "bench remote:" in capsys.readouterr().err
    assert main(["bench", "remote", "--quick", "--block-kib", "x"]) == 2
    assert main(["bench", "remote", "--quick", "--threads", "0"]) == 2
    assert main(["bench", "remote", "--quick", "--write-streams", "0"]) == 2
