"""The deployment examples in deploy/ (docs/deploy.md) work as written: the
systemd unit passes `systemd-analyze verify`, and in the Kubernetes Pod the
engine finds the sidecar the way `contract.endpoint` looks for it; both
give the sidecar a valid configuration."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from contract.endpoint import default_endpoint
from kvsidecar.cli import _load, build_parser
from sidecar.config import Config, group_id
from sidecar.runtime import endpoint_of

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy/systemd/kvsidecar.service"
POD = ROOT / "deploy/kubernetes/pod.yaml"
UNIT_BINARY = "/opt/kvsidecar/bin/kvsidecar"
HIDE_DEV_SHM = ("PrivateDevices", "PrivateIPC", "RemoveIPC", "DevicePolicy", "InaccessiblePaths")


def serve_config(argv: list[str], env: dict[str, str]) -> Config:
    """The configuration `kvsidecar serve` gets from this command line and environment."""
    assert Path(argv[0]).name == "kvsidecar" and argv[1] == "serve", argv
    return _load(build_parser().parse_args(argv[1:]), env)


# ---- systemd ------------------------------------------------------------------------


def unit_settings() -> list[tuple[str, str, str]]:
    """(section, key, value) of every setting of the unit, in order."""
    out, section = [], ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.append((section, key, value))
    return out


def unit_value(key: str) -> str:
    (value,) = [v for s, k, v in unit_settings() if s == "Service" and k == key]
    return value


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
    if not Path(analyze).is_file():
        pytest.skip("no systemd-analyze here")
    binary = Path(sys.executable).with_name("kvsidecar")  # the console script of this install
    if not binary.is_file():
        pytest.skip(f"no kvsidecar console script next to {sys.executable}")
    text = UNIT.read_text()
    assert text.count(UNIT_BINARY) == 1
    rendered = tmp_path / "kvsidecar.service"
    rendered.write_text(text.replace(UNIT_BINARY, str(binary)))
    done = subprocess.run(
        [analyze, "verify", str(rendered)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr


def test_the_unit_runs_a_notifying_sidecar_in_its_runtime_directory() -> None:
    assert unit_value("Type") == "notify"
    env = dict(v.partition("=")[::2] for s, k, v in unit_settings() if k == "Environment")
    config = serve_config(shlex.split(unit_value("ExecStart")), env)
    assert config.runtime_dir == f"/run/{unit_value('RuntimeDirectory')}"
    mode = int(unit_value("RuntimeDirectoryMode"), 8)
    assert mode & 0o027 == 0  # writable by group or others: the sidecar refuses it
    assert unit_value("User") and unit_value("Group")
    # Engines of other users in Group reach the socket and map the segments.
    assert config.group == unit_value("Group") != unit_value("User")
    assert mode & 0o050 == 0o050  # else the sidecar refuses it with group set
    # The engines map the segments in the host's /dev/shm.
    assert not [k for s, k, v in unit_settings() if k in HIDE_DEV_SHM], "hides /dev/shm"


# ---- Kubernetes -----------------------------------------------------------------------


def pod() -> dict[str, Any]:
    doc = yaml.safe_load(POD.read_text())
    assert doc["apiVersion"] == "v1" and doc["kind"] == "Pod"
    return doc  # type: ignore[no-any-return]


def containers(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the sidecar, the engine)."""
    every = [*spec.get("initContainers", []), *spec["containers"]]
    sidecars = [c for c in every if c.get("command", [])[:2] == ["kvsidecar", "serve"]]
    engines = [c for c in every if c not in sidecars]
    assert len(sidecars) == 1 and len(engines) == 1
    return sidecars[0], engines[0]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def mounts_of(container: dict[str, Any]) -> dict[str, str]:
    """mount path -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def volume_at(container: dict[str, Any], path: str) -> tuple[str, str]:
    """(volume, mount path) of the mount that holds `path` in `container`."""
    held = [
        (name, mount)
        for mount, name in mounts_of(container).items()
        if PurePosixPath(path).is_relative_to(mount)
    ]
    assert held, f"{path} is on no volume of {container['name']}"
    return max(held, key=lambda h: len(h[1]))


def test_dev_shm_is_one_memory_volume_in_both_containers() -> None:
    spec = pod()["spec"]
    sidecar, engine = containers(spec)
    volumes = {v["name"]: v for v in spec["volumes"]}
    name = mounts_of(sidecar)["/dev/shm"]
    assert mounts_of(engine)["/dev/shm"] == name
    assert volumes[name]["emptyDir"]["medium"] == "Memory"


def test_the_engine_finds_the_sidecar_on_a_shared_volume() -> None:
    spec = pod()["spec"]
    sidecar, engine = containers(spec)
    config = serve_config(sidecar["command"] + sidecar["args"], env_of(sidecar))
    # What the shim connects to, from the engine's environment.
    assert default_endpoint(env_of(engine)) == endpoint_of(config)
    runtime_dir = config.runtime_dir
    assert runtime_dir is not None and runtime_dir == env_of(engine)["KVSIDECAR_RUNTIME_DIR"]
    volume, mount = volume_at(sidecar, runtime_dir)
    assert volume_at(engine, runtime_dir) == (volume, mount)
    assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}[volume]
    # An emptyDir is writable by all: the sidecar makes its own 0700 directory in it.
    assert runtime_dir != mount


def test_the_sidecar_serves_the_engines_group_as_a_user_of_its_own() -> None:
    spec = pod()["spec"]
    sidecar, engine = containers(spec)

    def run_as(container: dict[str, Any], key: str) -> int:
        value = container.get("securityContext", {}).get(key, spec["securityContext"][key])
        assert isinstance(value, int)
        return value

    config = serve_config(sidecar["command"] + sidecar["args"], env_of(sidecar))
    gid = group_id(config.group)
    assert run_as(sidecar, "runAsUser") != run_as(engine, "runAsUser")
    # The sidecar may give its files to the group; the engine is in it.
    assert run_as(sidecar, "runAsGroup") == gid == run_as(engine, "runAsGroup")


def test_the_sidecar_settings_are_a_valid_configuration() -> None:
    sidecar, _ = containers(pod()["spec"])
    env = env_of(sidecar)
    assert all(name.startswith("KVSIDECAR_") for name in env)
    config = serve_config(sidecar["command"] + sidecar["args"], env)
    assert config.cpu_capacity == 16 * 2**30 and config.eviction_policy == "lru"
    probe = sidecar["startupProbe"]["exec"]["command"]
    assert build_parser().parse_args(probe[1:]).command == "status"
