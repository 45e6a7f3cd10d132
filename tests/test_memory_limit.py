"""The cgroup memory limit the default CPU tier is sized by, read from fake
cgroup trees (v2, v1, a container without a cgroup namespace, none)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from sidecar.memory_limit import cgroup_memory_limit
from sidecar.server.server import default_cpu_capacity

GiB = 1 << 30
V1_UNLIMITED = "9223372036854771712"


def tree(root: Path, own: str, files: dict[str, str]) -> str:
    """A fake root: /proc/self/cgroup holding `own`, and `files` (paths
    relative to the root) holding their text."""
    for path, text in {"proc/self/cgroup": own, **files}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


def test_v2_the_lowest_limit_on_the_path_binds(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "sys/fs/cgroup/kubepods/memory.max": f"{8 * GiB}\n",
            "sys/fs/cgroup/kubepods/pod1/memory.max": f"{2 * GiB}\n",
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
            "sys/fs/cgroup/kubepods/pod2/memory.max": f"{GiB}\n",  # not ours
        },
    )
    assert cgroup_memory_limit(root) == 2 * GiB


def test_v1_memory_controller(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        "9:name=systemd:/docker/abc\n4:cpu,memory:/docker/abc\n1:cpuset:/\n",
        {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/docker/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{3 * GiB}\n",
        },
    )
    assert cgroup_memory_limit(root) == 3 * GiB


def test_container_without_a_cgroup_namespace(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; the mount's root is our cgroup.
    root = tree(
        tmp_path,
        "0::/system.slice/docker-abc.scope\n",
        {"sys/fs/cgroup/memory.max": f"{GiB}\n"},
    )
    assert cgroup_memory_limit(root) == GiB


@pytest.mark.parametrize(
    "files",
    [
        {},
        {"sys/fs/cgroup/a/memory.max": "max\n"},
        {"sys/fs/cgroup/memory/a/memory.limit_in_bytes": V1_UNLIMITED},
        {"sys/fs/cgroup/a/memory.max": "garbage\n"},
    ],
)
def test_no_limit(tmp_path: Path, files: dict[str, str]) -> None:
    root = tree(tmp_path, "4:memory:/a\n0::/a\n", files)
    assert cgroup_memory_limit(root) is None


def test_no_proc_file_reads_the_mount_roots(tmp_path: Path) -> None:
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/memory.max").write_text(f"{GiB}\n")
    assert cgroup_memory_limit(str(tmp_path)) == GiB


def test_this_host_reads_without_error() -> None:
    limit = cgroup_memory_limit()
    assert limit is None or limit > 0


def test_default_capacity_is_a_tenth_of_the_cgroup_limit(tmp_path: Path) -> None:
    ram = psutil.virtual_memory().total
    limit = min(2 * GiB, ram)
    root = tree(tmp_path, "0::/pod\n", {"sys/fs/cgroup/pod/memory.max": str(limit)})
    assert default_cpu_capacity(root) == max(64 << 20, limit // 10)


def test_default_capacity_keeps_its_floor_under_a_small_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/pod\n", {"sys/fs/cgroup/pod/memory.max": str(256 << 20)})
    assert default_cpu_capacity(root) == 64 << 20


def test_default_capacity_without_a_limit_is_a_tenth_of_ram(tmp_path: Path) -> None:
    ram = psutil.virtual_memory().total
    root = tree(tmp_path, "0::/\n", {})
    assert default_cpu_capacity(root) == max(64 << 20, min(ram // 10, 16 * GiB))
