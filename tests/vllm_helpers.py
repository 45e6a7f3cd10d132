"""Test doubles of the vLLM objects the connector reads, and builders of its
two halves against a real sidecar. The doubles carry exactly the attributes
the connector uses (see engine_shim.kvconnector.scheduler)."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sidecar_proc import DEADLINE

from engine_shim.kvconnector.geometry import KVGeometry
from engine_shim.kvconnector.scheduler import SchedulerSide
from engine_shim.kvconnector.settings import ConnectorSettings
from engine_shim.kvconnector.worker import WorkerSide

BLOCK = 16
NUM_BLOCKS = 32
HEADS, HEAD_DIM = 2, 8
GEOMETRY = KVGeometry("LBNHC", num_layers=2, block_size=BLOCK, num_kv_heads=HEADS,
                      head_dim=HEAD_DIM, dtype=torch.float32,
                      block_elems=BLOCK * HEADS * 2 * HEAD_DIM)  # fmt: skip


@dataclass
class Request:
    """What the connector reads of vLLM's Request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None


def prompt(n_tokens: int, start: int = 0) -> list[int]:
    return [(start + i) % 30_000 for i in range(n_tokens)]


def request(req_id: str, tokens: list[int], salt: bytes = b"") -> Request:
    """A request with vLLM-style chained sha256 block hashes of its full blocks."""
    hashes, parent = [], salt
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(
            parent + repr(tokens[i * BLOCK : (i + 1) * BLOCK]).encode()
        ).digest()
        hashes.append(parent)
    return Request(req_id, list(tokens), block_hashes=hashes)


def settings(endpoint: str, **overrides: Any) -> ConnectorSettings:
    values: dict[str, Any] = {
        "model_name": "tiny",
        "model_revision": "r1",
        "engine_id": f"test-{uuid.uuid4().hex[:8]}",
        "endpoint": endpoint,
        "lookup_async": False,
        "timeout": 2.0,
    }
    return ConnectorSettings(**{**values, **overrides})


def kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's `{layer name: [B, H, N, C] view}` of LBNHC memory (each block
    [N, H, C] contiguous, C = K and V): random (seed) or zeros (None)."""
    shape = (NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM)
    gen = torch.Generator().manual_seed(seed or 0)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
        ).permute(0, 2, 1, 3)
        for i in range(GEOMETRY.num_layers)
    }


class Tables(dict[str, list[int]]):
    """Block tables by request id: what vLLM's cache manager tells the scheduler side."""

    def __call__(self, req_id: str) -> list[int]:
        return self[req_id]


@dataclass
class StepOutput:
    """What the scheduler side reads of vLLM's SchedulerOutput."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)


def scheduler_side(
    s: ConnectorSettings,
    *,
    use_block_hashes: bool = False,
    tables: Tables | None = None,
    geometry: KVGeometry = GEOMETRY,
) -> SchedulerSide:
    return SchedulerSide(
        s, geometry, use_block_hashes=use_block_hashes, block_table=tables or Tables()
    )


def halves(
    endpoint: str, kv: dict[str, torch.Tensor], *, use_block_hashes: bool = False, **overrides: Any
) -> tuple[SchedulerSide, WorkerSide]:
    """(scheduler side, worker side); the scheduler side's block tables are
    `tables_of(sched)`."""
    s = settings(endpoint, **overrides)
    worker = WorkerSide(s, GEOMETRY)
    worker.register(kv)
    return scheduler_side(s, use_block_hashes=use_block_hashes), worker


def tables_of(sched: SchedulerSide) -> Tables:
    tables = sched._block_table
    assert isinstance(tables, Tables)
    return tables


def blocks_of(kv: dict[str, torch.Tensor], ids: list[int]) -> list[np.ndarray]:
    """The K and V of engine blocks `ids`, per layer."""
    return [t[ids].numpy().copy() for t in kv.values()]


def matched_eventually(sched: SchedulerSide, req: Request, want: tuple[int, bool]) -> None:
    """Ask for `req`'s cached tokens until the answer is `want`: a TP save's
    last rank may still be reporting when the test asks."""
    deadline = time.monotonic() + DEADLINE
    while sched.num_new_matched_tokens(req, 0) != want:
        sched._forget(req.request_id)
        assert time.monotonic() < deadline
        time.sleep(0.005)
