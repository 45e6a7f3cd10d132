"""The memory this process may use: its cgroup's limit, where one is set.

A container's memory limit is its cgroup's: `memory.max` in cgroup v2
("max" = none), `memory.limit_in_bytes` in v1 (a number near 2^63 = none).
The shm pages of the CPU tier count against it (tmpfs pages are charged to
the cgroup that first touches them), so a tier sized from the host's RAM
alone would get the sidecar OOM-killed in a small pod.

The limit that binds is the lowest on the path from the process's own
cgroup (`/proc/self/cgroup`) up to the root of the hierarchy, so every
level's file is read. Inside a container without a cgroup namespace,
/proc/self/cgroup names the host's path while the container's own cgroup is
mounted at /sys/fs/cgroup: the levels of that path that do not exist under
the mount are skipped, and its root (the container's cgroup) is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import NamedTuple

V2_MOUNT = "sys/fs/cgroup"
V2_FILE = "memory.max"
V1_MOUNT = "sys/fs/cgroup/memory"
V1_FILE = "memory.limit_in_bytes"
UNLIMITED = 1 << 62
"""At or above this, a limit is "none" (v1 writes 2^63 less a page)."""


class OwnCgroups(NamedTuple):
    """The process's cgroup paths, as /proc/self/cgroup gives them."""

    v2: str
    """The unified hierarchy's ("0::<path>"); "/" if none."""
    v1_memory: str
    """The v1 memory controller's ("<id>:...memory...:<path>"); "/" if none."""


def cgroup_memory_limit(root: str = "/") -> int | None:
    """The lowest memory limit, in bytes, of this process's cgroups (v2 and
    v1) and their ancestors; None if none is set or none can be read.
    `root`: where the filesystem is (tests give a fake tree)."""
    own = own_cgroups(Path(root, "proc/self/cgroup"))
    limits = [
        *_limits(Path(root, V2_MOUNT), own.v2, V2_FILE),
        *_limits(Path(root, V1_MOUNT), own.v1_memory, V1_FILE),
    ]
    finite = [limit for limit in limits if limit < UNLIMITED]
    return min(finite, default=None)


def own_cgroups(path: Path) -> OwnCgroups:
    """Parse /proc/self/cgroup (lines `id:controllers:path`); a file that is
    missing or unreadable gives the roots."""
    v2 = v1_memory = "/"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return OwnCgroups(v2, v1_memory)
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, cgroup = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = cgroup
        elif "memory" in controllers.split(","):
            v1_memory = cgroup
    return OwnCgroups(v2, v1_memory)


def _limits(mount: Path, cgroup: str, name: str) -> Iterator[int]:
    """The limit in `name` at each level from `mount` down to `mount/cgroup`
    that exists and holds a number."""
    levels = [mount]
    for part in PurePosixPath(cgroup).parts[1:]:
        levels.append(levels[-1] / part)
    for directory in levels:
        try:
            text = (directory / name).read_text().strip()
        except OSError:  # no such level, or no limit file at this level (the root)
            continue
        if text.isdigit():
            yield int(text)
