"""Fixtures shared by the test modules. pytest finds them here: no test
module imports a fixture."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from collections.abc import Iterator

import pytest
from redis_servers import RedisServer, ensure_redis
from sidecar_proc import TMP_PREFIX, Sidecar, connect

from engine_shim import parts
from sidecar.tiers.remote.redis import RedisConnector

# ---- leaks: what a test process leaves in /tmp and /dev/shm ---------------------------


def _made_here() -> set[str]:
    """The /tmp directories and /dev/shm segments that are this process's by
    name: /tmp/kvs-t<pid>-* (sidecar_proc.tmp_dir) and kvsidecar.<uid>.<tag><pid>-*
    (the instance names of Sidecar, test_sidecar_ssd's Instance, LocalSidecar
    and the refused `serve`s of test_runtime_dir). Other processes' entries,
    another engineer's test run's included, never match."""
    pid = os.getpid()
    tmp = f"{TMP_PREFIX}{pid}-"
    shm = re.compile(rf"kvsidecar\.\d+\.[A-Za-z]*{pid}-")
    found = {f"/tmp/{n}" for n in os.listdir("/tmp") if n.startswith(tmp)}
    return found | {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if shm.match(n)}


def _uncleaned() -> list[Sidecar]:
    """Sidecars not cleaned up yet. sidecar_proc is imported under two names
    (`sidecar_proc`, and `tests.sidecar_proc` by the router tests): both."""
    found: list[Sidecar] = []
    for name in ("sidecar_proc", "tests.sidecar_proc"):
        module = sys.modules.get(name)
        if module is not None:
            found += module.UNCLEANED
    return found


def _clean_up_sidecars_made_since(before: list[Sidecar]) -> None:
    for s in _uncleaned():
        if s not in before:
            s.cleanup()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Fails the run (an error at the teardown of this worker's last test)
    if the tests left a directory in /tmp or a segment in /dev/shm that this
    process made: per process, so each pytest-xdist worker checks its own,
    and entries that were there before it started are not counted. Torn down
    last: after every module's and test's own teardown."""
    before = _made_here()
    yield
    _clean_up_sidecars_made_since([])
    left = sorted(_made_here() - before)
    for path in left:  # reported below; removed, so that they do not pile up
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert not left, f"the tests left these behind (now removed): {left}"


@pytest.fixture(scope="module", autouse=True)
def _sidecars_of_the_module() -> Iterator[None]:
    """Cleans up the sidecars a module's fixtures made and left (a module
    fixture that failed half way), after the module's own teardown."""
    before = list(_uncleaned())
    yield
    _clean_up_sidecars_made_since(before)


@pytest.fixture(autouse=True)
def _sidecars_of_the_test() -> Iterator[None]:
    """Cleans up every Sidecar a test (or its function fixtures) made and did
    not clean up: never started, a failure before its `finally`, a twin made
    only to be refused. Runs after the test's own fixtures' teardown."""
    before = list(_uncleaned())
    yield
    _clean_up_sidecars_made_since(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread while a module runs: `pytest -n 2` puts two workers
    on two cores, where a second torch thread per worker only spins (measured:
    a 40 ms forward took up to 1.2 s). Results do not depend on it: every
    comparison is between runs of the same process. A module that runs torch
    models asks for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def sidecar():
    """A started sidecar (4 MiB CPU tier), stopped at teardown: it must exit
    0 and leave no shm segment behind."""
    s = Sidecar().start()
    yield s
    try:
        if s.proc is not None and s.proc.poll() is None:
            assert s.stop() == 0
        assert s.shm_segments() == [], "shm segments outlived the sidecar"
    finally:
        s.cleanup()


@pytest.fixture
def open_client():
    """`connect`, with every client it made closed at teardown (its shm
    unmapped, its heartbeat stopped) even when the test fails: a mapping
    left open would outlive the test in this xdist worker. Ask for it after
    `sidecar`, so the clients close before the sidecar stops."""
    clients = []

    def open_(endpoint: str, kv: list, **kwargs: object):
        client = connect(endpoint, kv, **kwargs)
        clients.append(client)
        return client

    yield open_
    for client in reversed(clients):
        client.close()


# ---- a real redis-server (tests of the remote tier) --------------------------------


@pytest.fixture(scope="session")
def redis_bin() -> None:
    """redis-server is installed (the Debian package), or the test fails."""
    ensure_redis()


@pytest.fixture
def server(redis_bin: None) -> Iterator[RedisServer]:
    """A fresh redis-server on 127.0.0.1, stopped and removed after the test."""
    s = RedisServer().start()
    yield s
    s.cleanup()


@pytest.fixture
def connector(server: RedisServer) -> Iterator[RedisConnector]:
    c = RedisConnector(server.url, timeout=2.0)
    yield c
    c.close()


@pytest.fixture(params=["whole", "in_parts"])
def asked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How this process asks for a load whose CPU prefix ends before it does:
    as one load (parts only past 4 MiB, more than a test loads), or in parts
    of one block each (`engine_shim.parts`)."""
    if request.param == "in_parts":
        monkeypatch.setattr(parts, "PART_BYTES", 1)
    else:
        monkeypatch.setattr(parts, "PART_BYTES", 1 << 40)
    return str(request.param)
