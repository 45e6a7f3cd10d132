"""`KVClient`: what an engine process imports to use a running sidecar.

    client = KVClient.connect()                        # the default `kvsidecar serve`
    client.register(kv_layers, model_name="llama", model_revision="abc", ...)
    n = client.lookup(token_ids)                       # cached tokens, block-aligned
    client.load(token_ids, block_ids).wait()           # cached prefix -> kv_layers
    client.save(token_ids, block_ids).wait()           # kv_layers -> sidecar

The client hashes tokens into block keys, asks the sidecar for a plan, runs
the engine side of it (copies between the engine's paged KV tensors and the
shared-memory CPU tier) and reports completion. Only ids and keys cross the
socket; KV bytes move through shared memory.

Failure policy: the cache is an optimisation, never a dependency. When the
sidecar is down or slow, `lookup` returns 0 within `timeout` seconds and
`load` / `save` raise `SidecarUnavailable` just as fast, so the engine
recomputes. The client re-registers by itself when a (restarted) sidecar
answers again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from contract import protocol as p
from contract import replies as r
from contract.blocks import KeyHasher, Namespace
from contract.endpoint import default_endpoint
from contract.ids import KEY_BYTES, KEY_DTYPE, BlockKeys
from contract.ops import OpKind
from contract.protocol import ErrorCode
from cuda_ext.copier import CpuBlockCopier, StagedBlockCopier, open_copier
from cuda_ext.gpu import GpuBlockCopier
from cuda_ext.layouts import KVPlanes, kv_planes
from engine_shim.channel import Channel, SidecarError, SidecarUnavailable
from shm.layout import BlockLayout
from shm.pool import ShmPool, ShmPoolError

__all__ = ["KVClient", "PlanOps", "SidecarError", "SidecarUnavailable", "TransferHandle"]


class TierTokens(NamedTuple):
    """Tokens counted by the tier they are (or were loaded) from."""

    cpu: int
    ssd: int
    remote: int


@dataclass(frozen=True)
class PlanOps:
    """The engine side of a plan: what every TP rank copies. Picklable, so a
    TP leader can hand it to the other ranks (see `KVClient.execute`)."""

    plan_id: int
    kind: str
    """"load" or "save"."""
    ops: tuple[tuple[int, OpKind, np.ndarray, np.ndarray], ...]
    """(op id, H2D or D2H, source ids, destination ids)."""
    boot_id: str
    """The sidecar boot that made the plan: its slots mean nothing to another."""


class TransferHandle:
    """A load or save in flight. `wait()` returns once the sidecar has
    acknowledged it: after a save's wait, any engine's lookup sees the blocks
    (those another engine was saving when this save was planned land with
    that engine's save).

    A load into CUDA tensors returns while its copies are still queued on the
    copier's stream: `wait_layer(i)` lets the engine's stream start on layer
    i while later layers load; `wait()` blocks until every layer has landed,
    then tells the sidecar, which keeps the blocks' slots locked until then
    (so always call it)."""

    def __init__(
        self,
        client: KVClient,
        plan: PlanOps | None,
        num_tokens: int,
        ack: int | None,
        copies: Sequence[Any] = (),
    ):
        self.plan = plan
        self.num_tokens = num_tokens
        """Load: tokens now in the engine's KV cache. Save: tokens now cached."""
        self._client = client
        self._ack = ack
        self._copies = list(copies)  # queued GPU copies not yet reported complete

    @property
    def done(self) -> bool:
        return self._ack is None and not self._copies

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make `stream` (default: the current CUDA stream) wait until model
        layer `layer` of a load has landed; returns at once. Copies into CPU
        tensors have landed already."""
        for copy in self._copies:
            copy.wait_layer(layer, stream)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the copies have landed and the sidecar confirmed;
        returns `num_tokens`. Raises SidecarUnavailable after `timeout`
        (default: the client's), or the copy's error (reported to the sidecar
        as a failed op)."""
        if self._copies:
            copies, self._copies = self._copies, []
            assert self.plan is not None
            self._ack = self._client._report(self.plan, copies)
        if self._ack is not None:
            self._client._channel.wait_reply(self._ack, timeout)
            self._ack = None
        return self.num_tokens


class KVClient:
    def __init__(self, endpoint: str, timeout: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._channel = Channel(endpoint, timeout)
        self._channel.on_stray_plan = self._give_back
        self.session = uuid.uuid4().hex
        self._lookup_request = p.Lookup(v=p.PROTOCOL_VERSION, id=0, session=self.session)
        """Every lookup sends this one (the channel numbers it as it goes)."""
        self._register_args: dict[str, Any] | None = None
        self._planes: KVPlanes | None = None
        self._copier: CpuBlockCopier | GpuBlockCopier | StagedBlockCopier | None = None
        self._hasher: KeyHasher | None = None
        self._pool: ShmPool | None = None
        self._layout: BlockLayout | None = None
        self._boot_id: str | None = None
        """The boot of the sidecar whose shm this client has mapped."""
        self._live_boot: str | None = None
        """The boot the heartbeat last heard from (set by its thread)."""
        self._closed = False
        self.tp_rank = 0
        self._heartbeat: _Heartbeat | None = None
        self.registration = 0
        """How many times `register` has taken new tensors (a refused one does
        not count): a user of this client can tell that another re-registered it."""

    @classmethod
    def connect(cls, endpoint: str | None = None, *, timeout: float = 1.0) -> KVClient:
        """A client of the sidecar at `endpoint` (default: where `kvsidecar serve`
        listens with this environment's configuration). Connecting never
        blocks: a sidecar that is not up yet is found when it comes."""
        return cls(endpoint or default_endpoint(), timeout)

    # ---- registration -------------------------------------------------------------

    def register(
        self,
        kv_layers: torch.Tensor | Sequence[torch.Tensor],
        *,
        model_name: str,
        model_revision: str,
        tokens_per_block: int,
        num_kv_heads: int,
        head_dim: int,
        layout: str = "paged",
        layout_detail: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        engine_id: str | None = None,
        tenant: str = "",
        secret: bytes = b"",
        key_hash: str = "blake2b",
    ) -> None:
        """Describe this rank's paged KV cache, CPU or CUDA tensors in `layout`:
        "paged" (= "block_major": one tensor per layer, [num_blocks, ...]),
        "vllm_flash", "flashinfer", "cross_layer" or "mla" (cuda_ext.layouts).
        CUDA tensors copy with libkvcopy.so, or where it cannot run with torch's
        slower staged path (cuda_ext.copier.StagedBlockCopier; a warning says so).
        `layout_detail` tells apart engine layouts that give one cuda_ext
        layout different byte orders (it joins the namespace). With TP,
        every rank registers with the same `engine_id` and its own `tp_rank`.
        Raises SidecarUnavailable if the sidecar does not answer (these
        tensors are registered when it does), SidecarError if it refuses
        (e.g. a layout another engine disagrees with): a client registered
        before then keeps its registration, as the sidecar does."""
        if self._closed:
            raise RuntimeError("this client is closed")
        planes = kv_planes(kv_layers, layout)  # TypeError / ValueError for bad tensors
        _check_geometry(kv_layers, planes.layout, tokens_per_block, num_kv_heads, head_dim)
        namespace = Namespace(
            model_name=model_name,
            model_revision=model_revision,
            layout=f"{layout}/{layout_detail}" if layout_detail else layout,
            dtype=str(planes.dtype).removeprefix("torch."),
            tp_size=tp_size,
            num_layers=len(planes.planes),  # planes: the slot layout counts these
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            tokens_per_block=tokens_per_block,
            tenant=tenant,
        )
        hasher = KeyHasher(namespace, secret, key_hash)
        args = {
            "engine_id": engine_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}",
            "kv": p.KVLayoutMsg(
                **dataclasses.asdict(namespace),
                tp_rank=tp_rank,
                layer_block_bytes=planes.chunk_bytes,
                num_gpu_blocks=planes.num_blocks,
            ),
            "pid": os.getpid(),
            "pid_ns": _pid_namespace(),
        }
        before = (self._hasher, self._planes, self.tp_rank, self._register_args, self._copier)
        self._hasher, self._planes, self._register_args = hasher, planes, args
        self.tp_rank, self._copier = tp_rank, None
        try:
            reply, _ = self._channel.call(self._register_request())
        except SidecarError:
            # Refused: the sidecar keeps the registration it had, and so does this client.
            self._hasher, self._planes, self.tp_rank, self._register_args, self._copier = before
            raise
        finally:
            if self._register_args is args:  # taken now, or once a sidecar answers
                self.registration += 1
                if before[4] is not None:
                    before[4].close()
        self._registered(reply)

    def _register(self) -> None:
        """Register (again) what `register` was last given."""
        reply, _ = self._channel.call(self._register_request())
        self._registered(reply)

    def _registered(self, reply: r.RegisterReply) -> None:
        """Map the sidecar's shm and open the copier as a Register reply says;
        the heartbeat starts with the first success, which may be a later
        call's re-registration."""
        if reply.boot_id != self._boot_id or self._pool is None:
            self._attach(reply)
        if self._copier is None:
            self._open_copier(reply)
        self.lease_seconds = reply.lease_seconds
        if self._heartbeat is None:
            self._heartbeat = _Heartbeat(self)

    def _register_request(self) -> p.Register:
        assert self._register_args is not None
        return p.Register(v=p.PROTOCOL_VERSION, id=0, session=self.session, **self._register_args)

    def _attach(self, reply: r.RegisterReply) -> None:
        """Map the (new) sidecar's segments."""
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        try:
            self._pool = ShmPool.attach(reply.segments, reply.segment_sizes)
        except (OSError, ShmPoolError) as err:  # that sidecar went away since it replied
            raise SidecarUnavailable(f"cannot map the sidecar's shared memory: {err}") from None
        self._boot_id = self._live_boot = reply.boot_id

    def _pool_is_stale(self) -> bool:
        """The heartbeat met a sidecar other than the one whose pool is mapped
        here (it restarted): the next call or plan maps the new pool."""
        return self._live_boot not in (None, self._boot_id)

    def _open_copier(self, reply: r.RegisterReply) -> None:
        """The copier between the registered tensors and the mapped pool."""
        kv = self._register_args["kv"]  # type: ignore[index]
        self._layout = BlockLayout(
            num_layers=kv.num_layers, layer_block_bytes=kv.layer_block_bytes, tp_size=kv.tp_size
        )
        if self._layout.slot_stride != reply.slot_stride:
            raise SidecarError(
                ErrorCode.LAYOUT_MISMATCH, "the sidecar's slot stride differs from ours"
            )
        assert self._planes is not None and self._pool is not None
        self._copier = open_copier(self._planes, self._pool)  # pins the pool once (GPU)

    def _call(self, request: Any, arrays: Sequence[bytes] = ()) -> tuple[dict, list[bytes]]:
        """A request on this session; re-registers once if the sidecar forgot us."""
        if self._register_args is None:
            raise RuntimeError("this client is closed" if self._closed else "register() first")
        if self._copier is None or self._pool_is_stale():
            # The last Register got no reply in time (the sidecar may know the
            # session all the same, but the pool is not mapped here yet), or
            # the heartbeat met a restarted sidecar: map its pool now, and
            # unmap the old one, whose RAM this mapping alone keeps.
            self._register()
        try:
            return self._channel.call(request, arrays)
        except SidecarError as err:
            if err.code is not ErrorCode.NOT_REGISTERED:
                raise
        self._register()
        return self._channel.call(request, arrays)

    # ---- the engine API ------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> int:
        """Leading tokens of `token_ids` the sidecar can load (a multiple of
        tokens_per_block). 0 when the sidecar is down, slow or refuses."""
        return sum(self._lookup(self._keys(token_ids)))

    def lookup_tiers(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> TierTokens:
        """`lookup`, split by the tier each leading block is in now (the
        fastest that holds it). All zero when the sidecar is down, slow or refuses."""
        return self._lookup(self._keys(token_ids))

    def lookup_keys(self, keys: BlockKeys) -> int:
        """`lookup` for precomputed keys (see `block_keys` / `digest_keys`)."""
        return sum(self._lookup(_checked_keys(keys)))

    def lookup_keys_tiers(self, keys: BlockKeys) -> TierTokens:
        """`lookup_tiers` for precomputed keys."""
        return self._lookup(_checked_keys(keys))

    def _lookup(self, keys: BlockKeys) -> TierTokens:
        if len(keys) == 0:
            return TierTokens(0, 0, 0)
        try:
            reply, _ = self._call(self._lookup_request, [p.keys_frame(keys)])
        except (SidecarUnavailable, SidecarError):
            return TierTokens(0, 0, 0)
        t = self._tokens_per_block
        return TierTokens(reply.cpu * t, reply.ssd * t, reply.remote * t)

    def load(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        block_ids: Sequence[int] | np.ndarray,
        *,
        skip_tokens: int = 0,
    ) -> TransferHandle:
        """Copy the cached prefix of `token_ids` into the engine blocks
        `block_ids` (one per full block of tokens). The first `skip_tokens`
        (block-aligned) are already in the engine's cache and are not copied.
        `handle.num_tokens` = tokens now in the cache (skipped ones included)."""
        return self.load_keys(self._keys(token_ids), block_ids, skip_tokens=skip_tokens)

    def load_keys(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray, *, skip_tokens: int = 0
    ) -> TransferHandle:
        """`load` for precomputed keys: one key per full block."""
        keys, blocks = self._keys_and_blocks(keys, block_ids)
        tpb = self._tokens_per_block
        if skip_tokens % tpb or not 0 <= skip_tokens <= len(keys) * tpb:
            raise ValueError(f"skip_tokens must be a multiple of {tpb} within the request")
        request = self._req(p.Load, skip=skip_tokens // tpb)
        reply, arrays = self._call(request, [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = _plan_ops(reply, arrays, "load")
        num_tokens = skip_tokens + reply.hit_blocks * tpb
        return self._run(plan, num_tokens)

    def save(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        block_ids: Sequence[int] | np.ndarray,
    ) -> TransferHandle:
        """Offer the full blocks of `token_ids`, held in engine blocks
        `block_ids`, to the sidecar. Blocks it already has are skipped.
        `handle.num_tokens` = tokens of the prefix cached once it (and any save
        of the same blocks already in flight from another engine) lands."""
        return self.save_keys(self._keys(token_ids), block_ids)

    def save_keys(self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray) -> TransferHandle:
        """`save` for precomputed keys: one key per full block."""
        keys, blocks = self._keys_and_blocks(keys, block_ids)
        reply, arrays = self._call(self._req(p.Save), [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = _plan_ops(reply, arrays, "save")
        # Blocks another engine is saving right now count: they land with its save.
        stored = reply.skipped_blocks + reply.stored_blocks + reply.in_flight_blocks
        return self._run(plan, stored * self._tokens_per_block)

    def execute(self, plan: PlanOps) -> TransferHandle:
        """Run this rank's part of a plan another rank of the engine asked for.
        SidecarUnavailable if the sidecar that made it has restarted since:
        nothing is copied, and the plan died with that sidecar."""
        return self._run(plan, 0)

    def exists(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> bool:
        """Whether every full block of `token_ids` is cached."""
        keys = self._keys(token_ids)
        reply, _ = self._call(self._req(p.Exists), [p.keys_frame(keys)])
        return bool(reply.exists)

    def delete(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> int:
        """Drop the last full block of `token_ids` and every cached block that
        extends it; returns blocks dropped. SidecarError(BUSY) if in use."""
        keys = self._keys(token_ids)
        reply, _ = self._call(self._req(p.Delete), [p.keys_frame(keys)])
        return int(reply.deleted_blocks)

    def stats(self) -> dict[str, Any]:
        reply, _ = self._channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        return reply.stats  # type: ignore[no-any-return]

    def close(self) -> None:
        """Unregister (best effort), stop heartbeats, unmap the shm. Idempotent.
        Not while another thread uses this client (a client is one thread's)."""
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._register_args is not None:
            with contextlib.suppress(SidecarUnavailable, SidecarError):
                self._channel.call(self._req(p.Unregister), timeout=min(self.timeout, 0.5))
            self._register_args = None
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._channel.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ------------------------------------------------------------------------------

    @property
    def _tokens_per_block(self) -> int:
        if self._hasher is None:
            raise RuntimeError("register() first")
        return self._hasher.tokens_per_block

    def _req(self, kind: type, **fields: Any) -> Any:
        return kind(v=p.PROTOCOL_VERSION, id=0, session=self.session, **fields)

    def block_keys(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> BlockKeys:
        """The keys of the full blocks of `token_ids` in this client's namespace."""
        return self._keys(token_ids)

    def digest_keys(self, digests: Sequence[bytes]) -> BlockKeys:
        """Keys, in this client's namespace, of blocks the engine already
        identifies by chained digests of its own (vLLM's block hashes), one
        per full block of tokens_per_block tokens; see KeyHasher.hash_digests."""
        if self._hasher is None:
            raise RuntimeError("register() first")
        return self._hasher.hash_digests(digests)

    def _keys(self, token_ids: Any) -> BlockKeys:
        if self._hasher is None:
            raise RuntimeError("register() first")
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        return self._hasher.hash_tokens(token_ids)

    def _keys_and_blocks(self, keys: BlockKeys, block_ids: Any) -> tuple[BlockKeys, np.ndarray]:
        keys = _checked_keys(keys)
        blocks = np.asarray(block_ids)
        if blocks.ndim != 1 or (blocks.size and blocks.dtype.kind not in "iu"):
            raise TypeError("block_ids must be a 1-D sequence of integers")
        if blocks.size < len(keys):
            raise ValueError(f"{len(keys)} full blocks of tokens but {blocks.size} block ids")
        return keys, blocks[: len(keys)].astype(np.int64)

    def _run(self, plan: PlanOps | None, num_tokens: int) -> TransferHandle:
        """Copy this rank's shard for every op and report them all at once: a
        save's at once (the sidecar may overwrite nothing until the bytes
        are in the slots, so the copy is waited for), a load's once its
        copies have landed (at once for CPU tensors; GPU: `handle.wait()`)."""
        if plan is None:
            return TransferHandle(self, None, num_tokens, None)
        if plan.boot_id != self._boot_id or self._pool_is_stale():
            # The sidecar restarted since this client mapped its shm (the
            # heartbeat registered the session with the new one): map it now.
            self._register()
            self._check_boot(plan)
        copier, layout, rank = self._copier, self._layout, self.tp_rank
        assert copier is not None and layout is not None
        copies: list[Any] = []
        try:
            for _, kind, src, dst in plan.ops:
                if kind is OpKind.H2D:
                    copies.append(copier.load(dst, src, layout, rank))
                else:
                    copies.append(copier.save(src, dst, layout, rank))
        except Exception as err:
            for copy in copies:  # the sidecar reuses the slots once told: let queued copies end
                with contextlib.suppress(Exception):
                    copy.synchronize()
            self._fail(plan, err)
            raise
        if plan.kind == "load" and not all(copy.query() for copy in copies):
            return TransferHandle(self, plan, num_tokens, None, copies)
        return TransferHandle(self, plan, num_tokens, self._report(plan, copies))

    def _report(self, plan: PlanOps, copies: Sequence[Any]) -> int:
        """Wait for the copies, then tell the sidecar; the id of its reply."""
        try:
            # The sidecar may reuse the slots once told: the bytes must have landed.
            for copy in copies:
                copy.synchronize()
        except Exception as err:
            self._fail(plan, err)
            raise
        self._check_boot(plan)  # a restart since the copies started: nothing to report to
        op_ids = [op[0] for op in plan.ops]
        return self._channel.send(self._req(p.Complete, plan_id=plan.plan_id, op_ids=op_ids))

    def _check_boot(self, plan: PlanOps) -> None:
        """SidecarUnavailable if the sidecar that made `plan` has restarted
        since (seen by this thread, or by the heartbeat): nothing is told a
        sidecar that does not know the plan."""
        if plan.boot_id != self._boot_id or self._live_boot not in (None, plan.boot_id):
            raise SidecarUnavailable(
                f"plan {plan.plan_id} was made by a sidecar that has restarted since"
            )

    def _fail(self, plan: PlanOps, err: Exception) -> None:
        self._channel.send(
            self._req(p.Fail, plan_id=plan.plan_id, op_id=plan.ops[0][0], reason=repr(err)),
            reply=False,
        )

    def _give_back(self, plan_id: int) -> None:
        """A load or save was answered after this client stopped waiting: no
        copy ran for that plan, so cancel it (its locks and slots go back)."""
        with contextlib.suppress(SidecarUnavailable):  # gone, and its plans with it
            self._channel.send(self._req(p.Cancel, plan_id=plan_id), reply=False)


def _check_geometry(
    kv: Any, layout: str, tokens_per_block: int, num_kv_heads: int, head_dim: int
) -> None:
    """ValueError when tensors whose shape spells out tokens, heads and head
    dim (vllm_flash, flashinfer, mla, and block_major `[N, 2, tokens, heads,
    dim]`) say other numbers than the register arguments, which name the
    blocks' bytes in the namespace and set how many tokens a block keys.
    Free-form planes (`[N, elements]`, a padded engine page) are not checked."""
    first = kv if isinstance(kv, torch.Tensor) else kv[0]
    shape = tuple(first.shape)
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


def _checked_keys(keys: Any) -> BlockKeys:
    """Keys as made by `block_keys` / `digest_keys`; TypeError for anything else."""
    if not isinstance(keys, np.ndarray) or keys.dtype != KEY_DTYPE or keys.ndim != 1:
        raise TypeError(
            f"keys must be a 1-D array of {KEY_BYTES}-byte block keys from block_keys() or "
            f"digest_keys(), got {type(keys).__name__} {getattr(keys, 'dtype', '')}"
        )
    return BlockKeys(keys)


def _plan_ops(reply: r.PlanReply, arrays: list[bytes], kind: str) -> PlanOps | None:
    if not reply.ops:
        return None
    out = []
    for i, op in enumerate(reply.ops):
        src = np.frombuffer(arrays[2 * i], dtype=p.ID_DTYPE)
        dst = np.frombuffer(arrays[2 * i + 1], dtype=p.ID_DTYPE)
        out.append((op.op_id, op.kind, src, dst))
    return PlanOps(reply.plan_id, kind, tuple(out), reply.boot_id)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


class _Heartbeat:
    """Renews the lease from a thread with its own socket (sockets are not
    thread-safe); a missed beat is harmless, the next one re-registers."""

    def __init__(self, client: KVClient) -> None:
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvsidecar-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        channel = Channel(self._client.endpoint, self._client.timeout)
        try:
            while not self._stop.wait(max(0.01, self._client.lease_seconds / 3)):
                with contextlib.suppress(SidecarUnavailable, SidecarError):
                    self._beat(channel)  # a missed beat is harmless
        finally:
            channel.close()

    def _beat(self, channel: Channel) -> None:
        """Renew the lease. A sidecar that forgot the session (it restarted)
        learns it again here, so that a TP rank making no calls of its own
        completes its engine's group; the new sidecar's shm is mapped by the
        main thread, when a call or a plan first needs it (`_live_boot`)."""
        client = self._client
        try:
            reply, _ = channel.call(client._req(p.Heartbeat))
        except SidecarError as err:
            if err.code is not ErrorCode.NOT_REGISTERED:
                raise
            reply, _ = channel.call(client._register_request())
        client._live_boot = reply.boot_id

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
