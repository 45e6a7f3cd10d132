"""Fixtures shared by the test modules. pytest finds them here: no test
module imports a fixture."""

from __future__ import annotations

import pytest


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
