"""What `KVClient.register` was given, checked and made whole before the sidecar is asked."""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from contract import protocol as p
from contract.blocks import KeyHasher, Namespace
from cuda_ext.layouts import KVPlanes
from shm.layout import BlockLayout


class RegisterFields(TypedDict):
    """The Register request's own fields (the session's aside)."""

    engine_id: str
    kv: p.KVLayoutMsg
    pid: int
    pid_ns: str


@dataclass(frozen=True, eq=False)
class Registration:
    """One rank's registration as its client holds it: the Register request's
    fields, the key hasher of its namespace and the planes of its tensors,
    made whole from the `register` arguments before the sidecar is asked.
    Immutable: a client holds one at a time, so a register the sidecar
    refuses is undone by putting the previous one back, and one it takes
    replaces the previous one whole."""

    fields: RegisterFields
    planes: KVPlanes
    hasher: KeyHasher

    @classmethod
    def build(
        cls,
        planes: KVPlanes,
        namespace: Namespace,
        *,
        tp_rank: int,
        engine_id: str | None,
        secret: bytes,
        key_hash: str,
    ) -> Registration:
        """`engine_id` None: one of this process's own."""
        kv = p.KVLayoutMsg(
            **dataclasses.asdict(namespace),
            tp_rank=tp_rank,
            layer_block_bytes=planes.chunk_bytes,
            num_gpu_blocks=planes.num_blocks,
        )
        fields = RegisterFields(
            engine_id=engine_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}",
            kv=kv,
            pid=os.getpid(),
            pid_ns=_pid_namespace(),
        )
        return cls(fields, planes, KeyHasher(namespace, secret, key_hash))

    @property
    def tp_rank(self) -> int:
        return self.fields["kv"].tp_rank

    @property
    def layout(self) -> BlockLayout:
        """Where this rank's bytes of a block lie in a slot of the sidecar's pool."""
        kv = self.fields["kv"]
        return BlockLayout(
            num_layers=kv.num_layers, layer_block_bytes=kv.layer_block_bytes, tp_size=kv.tp_size
        )

    def request(self, session: str) -> p.Register:
        """The Register request of `session` (the channel numbers it)."""
        return p.Register(v=p.PROTOCOL_VERSION, id=0, session=session, **self.fields)


def check_geometry(
    kv: Any, layout: str, tokens_per_block: int, num_kv_heads: int, head_dim: int
) -> None:
    """ValueError when tensors whose shape spells out tokens, heads and head
    dim (vllm_flash, flashinfer, mla, and block_major `[N, 2, tokens, heads,
    dim]`) say other numbers than the register arguments, which name the
    blocks' bytes in the namespace and set how many tokens a block keys.
    Free-form planes (`[N, elements]`, a padded engine page) are not checked."""
    first = kv if isinstance(kv, torch.Tensor) else kv[0]
    shape = tuple(first.shape)
    told: tuple[int, ...]
    if layout == "mla":
        told, given = (tokens_per_block, head_dim), shape[1:]
        names = "(tokens_per_block, head_dim = latent dim)"
    elif layout in ("vllm_flash", "flashinfer") or (
        layout == "block_major" and len(shape) == 5 and shape[1] == 2
    ):
        told, given = (tokens_per_block, num_kv_heads, head_dim), shape[2:]
        names = "(tokens_per_block, num_kv_heads, head_dim)"
    else:
        return
    if given != told:
        raise ValueError(
            f"{layout} KV tensors shaped {shape} hold {given} {names}, but register() "
            f"was told {told}"
        )


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
