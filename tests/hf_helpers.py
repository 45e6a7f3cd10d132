"""Shared by the tests of the HF adapter, the demo and the TTFT benchmark."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One intra-op thread while a module runs: `pytest -n 2` puts two workers
    on two cores, where a second torch thread per worker only spins (measured:
    a 40 ms forward took up to 1.2 s). Results do not depend on it: every
    comparison is between runs of the same process."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tokens(seed: int, n: int) -> torch.Tensor:
    """`n` token ids below 1000 (tiny_llama's vocabulary), the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g)
