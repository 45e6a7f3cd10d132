"""Shared by the tests of the HF adapter, the demo and the TTFT benchmark (their
one-torch-thread fixture is in conftest.py)."""

from __future__ import annotations

import torch


def tokens(seed: int, n: int) -> torch.Tensor:
    """`n` token ids below 1000 (tiny_llama's vocabulary), the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g)
