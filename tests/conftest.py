"""Fixtures shared by the test modules. pytest finds them here: no test
module imports a fixture."""

from __future__ import annotations

import pytest
from sidecar_proc import Sidecar, connect


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
