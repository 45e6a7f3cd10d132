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

Its parts: what `register` takes, made whole (`registration`), a plan's
copies and the handle of a load or save in flight (`transfer`), the thread
that renews the lease (`heartbeat`), key and block id checks (`keys`), the
socket (`channel`), and the latency histogram of its calls (`call_metrics`).

Failure policy: the cache is an optimisation, never a dependency. When the
sidecar is down or slow, `lookup` returns 0 within `timeout` seconds and
`load` / `save` raise `SidecarUnavailable` just as fast, so the engine
recomputes. The client re-registers by itself when a (restarted) sidecar
answers again.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from contract import protocol as p
from contract import replies as r
from contract.blocks import KeyHasher, Namespace
from contract.endpoint import CurveClientKeys, curve_client_keys, default_endpoint
from contract.ids import BlockKey, BlockKeys
from contract.protocol import ErrorCode
from cuda_ext.copier import BlockCopier, CpuBlockCopier, open_copier
from cuda_ext.layouts import kv_planes
from engine_shim.call_metrics import timed_call
from engine_shim.channel import Channel, SidecarError, SidecarUnavailable
from engine_shim.heartbeat import Heartbeat
from engine_shim.hotpath import HotLane, token_array
from engine_shim.keys import checked_keys, keys_and_blocks
from engine_shim.registration import RegisterFields, Registration, check_geometry
from engine_shim.transfer import (
    Copy,
    EngineOp,
    LayeredTransfer,
    PlanOps,
    TransferHandle,
    queue_copies,
)
from shm import hotindex
from shm.layout import BlockLayout
from shm.pool import ShmPool, ShmPoolError

__all__ = ["KVClient", "TierTokens"]


class TierTokens(NamedTuple):
    """Tokens counted by the tier they are (or were loaded) from."""

    cpu: int
    ssd: int
    remote: int


class KVClient:
    def __init__(
        self,
        endpoint: str,
        timeout: float,
        *,
        curve: CurveClientKeys | None = None,
        hot_path: bool = True,
    ) -> None:
        """`curve`: keys for a sidecar that requires CURVE (tcp:// off
        loopback); None: those KVSIDECAR_CURVE_SERVER_KEY and
        KVSIDECAR_CURVE_CLIENT_KEY name, if set. `hot_path`: see the attribute."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.hot_path = hot_path
        """Whether lookups, CPU-hit loads and saves into granted slots may go
        through the sidecar's hot index in this process, without a round trip
        (engine_shim/hotpath.py); False: every one asks the sidecar (a CUDA
        load then returns with its copies queued, for per-layer waits). May
        be changed at any time."""
        self._curve = curve_client_keys() if curve is None else curve
        self._channel = Channel(endpoint, timeout, curve=self._curve)
        self._channel.on_stray_plan = self._give_back
        self.session = uuid.uuid4().hex
        self._lookup_request = p.Lookup(v=p.PROTOCOL_VERSION, id=0, session=self.session)
        """Every lookup sends this one (the channel numbers it as it goes)."""
        self._registered: Registration | None = None
        """What `register` last took (None before); kept once closed, for its keys."""
        self._pool: ShmPool | None = None
        self._boot_id: str | None = None
        """The boot of the sidecar whose shm this client has mapped."""
        self._live_boot: str | None = None
        """The boot the heartbeat last heard from (set by its thread)."""
        self._copier: BlockCopier | None = None
        """Between the registered tensors and the mapped pool: closed with either."""
        self._layout: BlockLayout | None = None
        self._hot = HotLane(
            self._channel,
            self.session,
            lease=lambda: self.lease_seconds,
            handle=lambda num_tokens, ack: self._handle(None, num_tokens, ack),
        )
        """The hot index of the sidecar whose pool is mapped, and what goes through it."""
        self._closed = False
        self._heartbeat: Heartbeat | None = None
        self.registration = 0
        """How many times `register` has taken new tensors (a refused one does
        not count): a user of this client can tell that another re-registered it."""

    @classmethod
    def connect(
        cls,
        endpoint: str | None = None,
        *,
        timeout: float = 1.0,
        curve: CurveClientKeys | None = None,
        hot_path: bool = True,
    ) -> KVClient:
        """A client of the sidecar at `endpoint` (default: where `kvsidecar serve`
        listens with this environment's configuration). Connecting never
        blocks: a sidecar that is not up yet is found when it comes. `curve`:
        see `KVClient`; `contract.endpoint.load_curve_client_keys` reads them
        from key files."""
        return cls(endpoint or default_endpoint(), timeout, curve=curve, hot_path=hot_path)

    @property
    def tp_rank(self) -> int:
        """This rank of its engine, as last registered (0 before)."""
        return 0 if self._registered is None else self._registered.tp_rank

    @property
    def _register_args(self) -> RegisterFields | None:
        """The Register request's own fields as last registered (None before,
        and once closed)."""
        return None if self._registered is None or self._closed else self._registered.fields

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
        "vllm_flash", "flashinfer", "cross_layer", "mla" or "strided" (per-layer
        views of any strides, e.g. vLLM's in every KV cache layout; cuda_ext.layouts).
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
        check_geometry(kv_layers, planes.layout, tokens_per_block, num_kv_heads, head_dim)
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
        self._take(
            Registration.build(
                planes,
                namespace,
                tp_rank=tp_rank,
                engine_id=engine_id,
                secret=secret,
                key_hash=key_hash,
            )
        )

    def _take(self, registration: Registration) -> None:
        """Register `registration` in place of the one this client holds,
        whole. Refused (SidecarError): the previous one is back as it was,
        as the sidecar keeps it. Unanswered (SidecarUnavailable): the new one
        stays, and is registered when a sidecar answers."""
        previous, self._registered = self._registered, registration
        try:
            reply, _ = self._channel.call(registration.request(self.session))
        except SidecarError:
            self._registered = previous
            raise
        finally:
            if self._registered is registration:  # taken now, or once a sidecar answers
                self.registration += 1
                self._close_copier()  # it copies the previous registration's tensors
        self._set_up(reply)

    def _register(self) -> None:
        """Register (again) what `register` last took (grants of the session
        are gone if the sidecar had forgotten it)."""
        reply, _ = self._channel.call(self._register_request())
        self._hot.grants_lost = True
        self._set_up(reply)

    def _set_up(self, reply: r.RegisterReply) -> None:
        """Map the sidecar's shm and open the copier as a Register reply says;
        the heartbeat starts with the first success, which may be a later
        call's re-registration."""
        if reply.boot_id != self._boot_id or self._pool is None:
            self._attach(reply)
        if self._copier is None:
            self._open_copier(reply)
        self._hot.map(reply.hot_index)
        self.lease_seconds = reply.lease_seconds
        self._hot.heard()
        if self._heartbeat is None:
            self._heartbeat = Heartbeat(
                self.endpoint,
                self.timeout,
                self.session,
                lease=lambda: self.lease_seconds,
                register_request=self._register_request,
                heard=self._heard,
                curve=self._curve,
                touch=self._hot.take_touch,
                rejoined=self._rejoined,
            )

    def _register_request(self) -> p.Register:
        return self._registration().request(self.session)

    def _registration(self) -> Registration:
        """What `register` last took; RuntimeError before it, or once closed."""
        if self._registered is None:
            raise RuntimeError("this client is closed" if self._closed else "register() first")
        return self._registered

    def _attach(self, reply: r.RegisterReply) -> None:
        """Map the (new) sidecar's segments."""
        self._close_copier()
        self._hot.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        try:
            self._pool = ShmPool.attach(reply.segments, reply.segment_sizes)
        except (OSError, ShmPoolError) as err:  # that sidecar went away since it replied
            raise SidecarUnavailable(f"cannot map the sidecar's shared memory: {err}") from None
        self._boot_id = self._live_boot = reply.boot_id

    def _heard(self, boot_id: str) -> None:
        """The heartbeat's thread heard from the sidecar of `boot_id`."""
        self._live_boot = boot_id
        self._hot.heard()

    def _rejoined(self) -> None:
        """The heartbeat registered the session again: its grants are gone."""
        self._hot.grants_lost = True

    def _pool_is_stale(self) -> bool:
        """The heartbeat met a sidecar other than the one whose pool is mapped
        here (it restarted): the next call or plan maps the new pool."""
        return self._live_boot not in (None, self._boot_id)

    def _open_copier(self, reply: r.RegisterReply) -> None:
        """The copier between the registered tensors and the mapped pool."""
        registration = self._registration()
        self._layout = registration.layout
        if self._layout.slot_stride != reply.slot_stride:
            raise SidecarError(
                ErrorCode.LAYOUT_MISMATCH, "the sidecar's slot stride differs from ours"
            )
        assert self._pool is not None
        self._copier = open_copier(registration.planes, self._pool)  # pins the pool once (GPU)

    def _hot_flags(self) -> int:
        """The hot index's flags while this client may use it, else 0: it is
        mapped for the sidecar whose pool is mapped, that sidecar is alive
        and serving it, and the copier is open."""
        if not self.hot_path or self._copier is None or self._pool_is_stale():
            return 0
        return self._hot.flags(self.timeout)

    def _close_copier(self) -> None:
        if self._copier is not None:
            self._copier.close()
            self._copier = None

    def _call(self, request: Any, arrays: Sequence[bytes] = ()) -> tuple[Any, list[bytes]]:
        """A request on this session; re-registers once if the sidecar forgot us."""
        self._registration()
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
        tokens_per_block). 0 when the sidecar is down, slow or refuses.
        Answered in this process from the hot index when the CPU tier holds
        them all (or the sidecar has no lower tier); else asked."""
        return sum(self._lookup_tokens(token_ids))

    def lookup_tiers(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> TierTokens:
        """`lookup`, split by the tier each leading block is in now (the
        fastest that holds it). All zero when the sidecar is down, slow or refuses."""
        return self._lookup_tokens(token_ids)

    @timed_call("lookup")
    def _lookup_tokens(self, token_ids: Any) -> TierTokens:
        flags = self._hot_flags()
        if not flags:
            return self._ask_lookup(self._keys(token_ids))
        tokens = token_array(token_ids)
        hit = self._hot.lookup_tokens(self._hasher, tokens, flags)
        if hit is None:  # the rest may be below: ask
            return self._ask_lookup(self._keys(tokens))
        return TierTokens(hit * self._tokens_per_block, 0, 0)

    def lookup_keys(self, keys: BlockKeys) -> int:
        """`lookup` for precomputed keys (see `block_keys` / `digest_keys`)."""
        return sum(self._lookup(checked_keys(keys)))

    def lookup_keys_tiers(self, keys: BlockKeys) -> TierTokens:
        """`lookup_tiers` for precomputed keys."""
        return self._lookup(checked_keys(keys))

    @timed_call("lookup")
    def _lookup(self, keys: BlockKeys) -> TierTokens:
        flags = self._hot_flags()
        hit = self._hot.lookup_keys(keys, flags) if flags else None
        if hit is not None:
            return TierTokens(hit * self._tokens_per_block, 0, 0)
        return self._ask_lookup(keys)

    def _ask_lookup(self, keys: BlockKeys) -> TierTokens:
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

    @timed_call("load")
    def load_keys(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray, *, skip_tokens: int = 0
    ) -> TransferHandle:
        """`load` for precomputed keys: one key per full block."""
        keys, blocks = keys_and_blocks(keys, block_ids)
        tpb = self._tokens_per_block
        if skip_tokens % tpb or not 0 <= skip_tokens <= len(keys) * tpb:
            raise ValueError(f"skip_tokens must be a multiple of {tpb} within the request")
        if self._hot_flags() & hotindex.LOADS:
            assert self._copier is not None and self._layout is not None
            skip = skip_tokens // tpb
            found = self._hot.load(self._copier, self._layout, keys, blocks, skip, self.timeout)
            if found is not None:
                return self._handle(None, skip_tokens + found * tpb, None)
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

    @timed_call("save")
    def save_keys(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray, *, skip_tokens: int = 0
    ) -> TransferHandle:
        """`save` for precomputed keys: one key per full block. The first
        `skip_tokens` (block-aligned) are a prefix this engine holds no
        bytes for (their block ids are placeholders, never read): blocks past
        it are stored only while the sidecar holds that whole prefix in its
        CPU tier, else nothing is (`handle.num_tokens` then falls short of
        `skip_tokens`)."""
        keys, blocks = keys_and_blocks(keys, block_ids)
        tpb = self._tokens_per_block
        if skip_tokens % tpb or not 0 <= skip_tokens <= len(keys) * tpb:
            raise ValueError(f"skip_tokens must be a multiple of {tpb} within the request")
        if not skip_tokens and self._hot_flags() & hotindex.SAVES:
            assert self._copier is not None and self._layout is not None
            num_tokens = len(keys) * tpb
            handle = self._hot.save(self._copier, self._layout, keys, blocks, num_tokens)
            if handle is not None:
                return handle
        request = self._req(p.Save, skip=skip_tokens // tpb)
        reply, arrays = self._call(request, [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = _plan_ops(reply, arrays, "save")
        # Blocks another engine is saving right now count: they land with its save.
        stored = reply.skipped_blocks + reply.stored_blocks + reply.in_flight_blocks
        return self._run(plan, stored * self._tokens_per_block)

    def layered_load_keys(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray, *, skip_tokens: int = 0
    ) -> LayeredTransfer:
        """`load_keys`, planned now, its copies queued layer by layer
        (`LayeredTransfer.copy_layers`) and reported by `finish().wait()`."""
        keys, blocks = keys_and_blocks(keys, block_ids)
        tpb = self._tokens_per_block
        if skip_tokens % tpb or not 0 <= skip_tokens <= len(keys) * tpb:
            raise ValueError(f"skip_tokens must be a multiple of {tpb} within the request")
        request = self._req(p.Load, skip=skip_tokens // tpb)
        reply, arrays = self._call(request, [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = _plan_ops(reply, arrays, "load")
        return self._layered(plan, skip_tokens + reply.hit_blocks * tpb)

    def layered_save_keys(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray
    ) -> LayeredTransfer:
        """`save_keys`, planned now (before the forward computes the blocks),
        its copies queued layer by layer as the layers are computed."""
        keys, blocks = keys_and_blocks(keys, block_ids)
        copier, layout = self._copier, self._layout
        if self._hot_flags() & hotindex.SAVES and isinstance(copier, CpuBlockCopier):
            assert layout is not None
            num_tokens = len(keys) * self._tokens_per_block
            transfer = self._hot.layered_save(copier, layout, keys, blocks, num_tokens)
            if transfer is not None:
                return transfer
        reply, arrays = self._call(
            self._req(p.Save, skip=0), [p.keys_frame(keys), p.ids_frame(blocks)]
        )
        plan = _plan_ops(reply, arrays, "save")
        stored = reply.skipped_blocks + reply.stored_blocks + reply.in_flight_blocks
        return self._layered(plan, stored * self._tokens_per_block)

    def execute_layered(self, plan: PlanOps) -> LayeredTransfer:
        """`execute`, layer by layer: this rank's part of another rank's plan."""
        return self._layered(plan, 0)

    def _layered(self, plan: PlanOps | None, num_tokens: int) -> LayeredTransfer:
        if plan is not None and (plan.boot_id != self._boot_id or self._pool_is_stale()):
            self._register()  # as `_run`: map a restarted sidecar's shm
            self._check_boot(plan)
        copier, layout = self._copier, self._layout
        if copier is None or layout is None:
            raise SidecarUnavailable("not registered with the sidecar yet")
        planes = copier.copied_planes
        if plan is None:
            return LayeredTransfer(
                None,
                num_tokens,
                planes.num_layers,
                planes.layer_splits,
                queue=None,
                finish=lambda copies: self._handle(None, num_tokens, None),
                fail=lambda err: None,
            )

        def finish(copies: Sequence[Copy]) -> TransferHandle:
            if plan.kind == "load" and not all(copy.query() for copy in copies):
                return self._handle(plan, num_tokens, None, copies)
            return self._handle(plan, num_tokens, self._report(plan, copies))

        return LayeredTransfer(
            plan,
            num_tokens,
            planes.num_layers,
            planes.layer_splits,
            queue=lambda layers: queue_copies(plan, copier, layout, self.tp_rank, layers),
            finish=finish,
            fail=lambda err: self._fail(plan, err),
        )

    def execute(self, plan: PlanOps) -> TransferHandle:
        """Run this rank's part of a plan another rank of the engine asked for.
        SidecarUnavailable if the sidecar that made it has restarted since:
        nothing is copied, and the plan died with that sidecar."""
        return self._run(plan, 0)

    def cancel(self, plan: PlanOps) -> None:
        """Tell the sidecar this rank will never run `plan` (another rank of
        the engine asked for it, and it came too late): the plan is rolled
        back. Best effort: a restarted sidecar took its plans along."""
        if plan.boot_id == self._boot_id:
            self._give_back(plan.plan_id)

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
        """The sidecar's figures (what this client did through the hot index
        is sent first, so they count it)."""
        self._hot.send_touch()
        reply, _ = self._channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        return reply.stats  # type: ignore[no-any-return]

    def close(self) -> None:
        """Unregister (best effort), stop heartbeats, unmap the shm. Idempotent.
        Not while another thread uses this client (a client is one thread's)."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._registered is not None:  # kept: its keys can still be computed
            self._hot.send_touch()
            with contextlib.suppress(SidecarUnavailable, SidecarError):
                self._channel.call(self._req(p.Unregister), timeout=min(self.timeout, 0.5))
        self._close_copier()
        self._hot.close()
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
    def _hasher(self) -> KeyHasher:
        """The key hasher of the registered namespace."""
        return self._registration().hasher

    @property
    def _tokens_per_block(self) -> int:
        return self._hasher.tokens_per_block

    def _req(self, kind: type, **fields: Any) -> Any:
        return kind(v=p.PROTOCOL_VERSION, id=0, session=self.session, **fields)

    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        parent: BlockKey | None = None,
    ) -> BlockKeys:
        """The keys of the full blocks of `token_ids` in this client's
        namespace; `parent`: the key of the block before them (None: they
        start the sequence), so a longer sequence's keys extend a shorter's."""
        return self._keys(token_ids, parent)

    def digest_keys(self, digests: Sequence[bytes], parent: BlockKey | None = None) -> BlockKeys:
        """Keys, in this client's namespace, of blocks the engine already
        identifies by chained digests of its own (vLLM's block hashes), one
        per full block of tokens_per_block tokens; see KeyHasher.hash_digests.
        `parent` as for `block_keys`."""
        return self._hasher.hash_digests(digests, parent)

    def _keys(self, token_ids: Any, parent: BlockKey | None = None) -> BlockKeys:
        hasher = self._hasher
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        return hasher.hash_tokens(token_ids, parent)

    def _run(self, plan: PlanOps | None, num_tokens: int) -> TransferHandle:
        """Copy this rank's shard for every op and report them all at once: a
        save's at once (the sidecar may overwrite nothing until the bytes
        are in the slots, so the copy is waited for), a load's once its
        copies have landed (at once for CPU tensors; GPU: `handle.wait()`)."""
        if plan is None:
            return self._handle(None, num_tokens, None)
        if plan.boot_id != self._boot_id or self._pool_is_stale():
            # The sidecar restarted since this client mapped its shm (the
            # heartbeat registered the session with the new one): map it now.
            self._register()
            self._check_boot(plan)
        assert self._copier is not None and self._layout is not None
        try:
            copies = queue_copies(plan, self._copier, self._layout, self.tp_rank)
        except Exception as err:
            self._fail(plan, err)
            raise
        if plan.kind == "load" and not all(copy.query() for copy in copies):
            return self._handle(plan, num_tokens, None, copies)
        return self._handle(plan, num_tokens, self._report(plan, copies))

    def _handle(
        self, plan: PlanOps | None, num_tokens: int, ack: int | None, copies: Sequence[Copy] = ()
    ) -> TransferHandle:
        return TransferHandle(
            plan, num_tokens, ack, copies, report=self._report, wait_reply=self._channel.wait_reply
        )

    def _report(self, plan: PlanOps, copies: Sequence[Copy]) -> int:
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


def _plan_ops(reply: r.PlanReply, arrays: list[bytes], kind: str) -> PlanOps | None:
    if not reply.ops:
        return None
    out = []
    for i, op in enumerate(reply.ops):
        src = np.frombuffer(arrays[2 * i], dtype=p.ID_DTYPE)
        dst = np.frombuffer(arrays[2 * i + 1], dtype=p.ID_DTYPE)
        out.append(EngineOp(op.op_id, op.kind, src, dst))
    return PlanOps(reply.plan_id, kind, tuple(out), reply.boot_id)
