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

Its parts: the session's hold on the sidecar, registration, mapped shm and
the engine side of plans (`link`), what `register` takes, made whole
(`registration`), a plan's copies and the handle of a load or save in flight
(`transfer`), the hot index lane (`hotpath`), the thread that renews the
lease (`heartbeat`), key and block id checks (`keys`), the socket
(`channel`), and the latency histogram of its calls (`call_metrics`).

Failure policy: the cache is an optimisation, never a dependency. When the
sidecar is down or slow, `lookup` returns 0 within `timeout` seconds and
`load` / `save` raise `SidecarUnavailable` just as fast, so the engine
recomputes. The client re-registers by itself when a (restarted) sidecar
answers again.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from contract import protocol as p
from contract.blocks import KeyHasher, Namespace
from contract.endpoint import CurveClientKeys, curve_client_keys, default_endpoint
from contract.ids import BlockKey, BlockKeys
from cuda_ext.copier import CpuBlockCopier
from cuda_ext.layouts import kv_planes
from engine_shim.call_metrics import timed_call
from engine_shim.channel import SidecarError, SidecarUnavailable
from engine_shim.hotpath import token_array
from engine_shim.keys import checked_keys, keys_and_blocks
from engine_shim.link import SidecarLink, plan_ops
from engine_shim.parts import load_in_parts, worth_parts
from engine_shim.registration import Registration, check_geometry
from engine_shim.transfer import LayeredTransfer, PlanOps, TransferHandle
from shm import hotindex
from shm.copy import has_repeats

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
        self.hot_path = hot_path
        """Whether lookups, CPU-hit loads and saves into granted slots may go
        through the sidecar's hot index in this process, without a round trip
        (engine_shim/hotpath.py); False: every one asks the sidecar (a CUDA
        load then returns with its copies queued, for per-layer waits). May
        be changed at any time."""
        self.session = uuid.uuid4().hex
        self._link = SidecarLink(
            endpoint, timeout, self.session, curve_client_keys() if curve is None else curve
        )
        self._lookup_request = p.Lookup(v=p.PROTOCOL_VERSION, id=0, session=self.session)
        """Every lookup sends this one (the channel numbers it as it goes)."""

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
    def timeout(self) -> float:
        """Seconds a call waits for the sidecar, and the hot index's
        liveness bound (the heartbeat keeps its own socket)."""
        return self._link.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._link.timeout = seconds

    @property
    def tp_rank(self) -> int:
        """This rank of its engine, as last registered (0 before)."""
        registered = self._link.registered
        return 0 if registered is None else registered.tp_rank

    @property
    def registration(self) -> int:
        """How many times `register` has taken new tensors (a refused one does
        not count): a user of this client can tell that another re-registered it."""
        return self._link.registrations

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
        Raises SidecarUnavailable if the sidecar does not answer, or is
        shutting down (these tensors are registered with the sidecar that
        answers next), SidecarError if it refuses
        (e.g. a layout another engine disagrees with): a client registered
        before then keeps its registration, as the sidecar does."""
        if self._link.closed:
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
        self._link.take(
            Registration.build(
                planes,
                namespace,
                tp_rank=tp_rank,
                engine_id=engine_id,
                secret=secret,
                key_hash=key_hash,
            )
        )

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
        hit = self._link.hot.lookup_tokens(self._hasher, tokens, flags)
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
        hit = self._link.hot.lookup_keys(keys, flags) if flags else None
        if hit is not None:
            return TierTokens(hit * self._tokens_per_block, 0, 0)
        return self._ask_lookup(keys)

    def _ask_lookup(self, keys: BlockKeys) -> TierTokens:
        if len(keys) == 0:
            return TierTokens(0, 0, 0)
        try:
            reply, _ = self._link.call(self._lookup_request, [p.keys_frame(keys)])
        except (SidecarUnavailable, SidecarError):
            return TierTokens(0, 0, 0)
        t = self._tokens_per_block
        return TierTokens(reply.cpu * t, reply.ssd * t, reply.remote * t)

    def _checked(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray, skip_tokens: int
    ) -> tuple[BlockKeys, np.ndarray]:
        """A load's or save's keys and engine block ids, checked as the
        sidecar checks them, before anything is asked or copied (the hot path
        asks nothing): ValueError unless `skip_tokens` is block-aligned within
        the request and every block id past it is distinct (a save would store
        one engine block under several keys; a load would copy into it twice)."""
        keys, blocks = keys_and_blocks(keys, block_ids)
        tpb = self._tokens_per_block
        if skip_tokens % tpb or not 0 <= skip_tokens <= len(keys) * tpb:
            raise ValueError(f"skip_tokens must be a multiple of {tpb} within the request")
        if has_repeats(blocks[skip_tokens // tpb :]):
            raise ValueError("block_ids repeat: each block needs its own engine block")
        return keys, blocks

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
        keys, blocks = self._checked(keys, block_ids, skip_tokens)
        tpb = self._tokens_per_block
        link = self._link
        if self._hot_flags() & hotindex.LOADS:
            assert link.copier is not None and link.layout is not None
            skip = skip_tokens // tpb
            found = link.hot.load(link.copier, link.layout, keys, blocks, skip, self.timeout)
            if found is not None:
                return link.handle(None, skip_tokens + found * tpb, None)
            # A CPU miss with lower tiers below: staged by the sidecar, in parts.
            layout = link.layout
            if (
                layout.tp_size == 1
                and p.LOAD_END in link.features
                and worth_parts(len(keys) - skip, layout.block_bytes)
            ):
                handle = load_in_parts(link, keys, blocks, skip, tpb)
                if handle is not None:
                    return handle
        request = link.req(p.Load, skip=skip_tokens // tpb)
        reply, arrays = link.call(request, [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = plan_ops(reply, arrays, "load")
        return link.run(plan, skip_tokens + reply.hit_blocks * tpb)

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
        keys, blocks = self._checked(keys, block_ids, skip_tokens)
        tpb = self._tokens_per_block
        link = self._link
        if not skip_tokens and self._hot_flags() & hotindex.SAVES:
            assert link.copier is not None and link.layout is not None
            num_tokens = len(keys) * tpb
            handle = link.hot.save(link.copier, link.layout, keys, blocks, num_tokens)
            if handle is not None:
                return handle
        request = link.req(p.Save, skip=skip_tokens // tpb)
        reply, arrays = link.call(request, [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = plan_ops(reply, arrays, "save")
        # Blocks another engine is saving right now count: they land with its save.
        stored = reply.skipped_blocks + reply.stored_blocks + reply.in_flight_blocks
        return self._link.run(plan, stored * self._tokens_per_block)

    def layered_load_keys(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray, *, skip_tokens: int = 0
    ) -> LayeredTransfer:
        """`load_keys`, planned now, its copies queued layer by layer
        (`LayeredTransfer.copy_layers`) and reported by `finish().wait()`."""
        keys, blocks = self._checked(keys, block_ids, skip_tokens)
        tpb = self._tokens_per_block
        request = self._link.req(p.Load, skip=skip_tokens // tpb)
        reply, arrays = self._link.call(request, [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = plan_ops(reply, arrays, "load")
        return self._link.layered(plan, skip_tokens + reply.hit_blocks * tpb)

    def layered_save_keys(
        self, keys: BlockKeys, block_ids: Sequence[int] | np.ndarray
    ) -> LayeredTransfer:
        """`save_keys`, planned now (before the forward computes the blocks),
        its copies queued layer by layer as the layers are computed."""
        keys, blocks = self._checked(keys, block_ids, 0)
        copier, layout = self._link.copier, self._link.layout
        flags = self._hot_flags()
        if flags & hotindex.SAVES and isinstance(copier, CpuBlockCopier):
            assert layout is not None
            num_tokens = len(keys) * self._tokens_per_block
            transfer = self._link.hot.layered_save(copier, layout, keys, blocks, num_tokens)
            if transfer is not None:
                return transfer
        # The other ranks get the plan before this one has copied a layer.
        request = self._link.req(p.Save, skip=0, shared_early=True)
        reply, arrays = self._link.call(request, [p.keys_frame(keys), p.ids_frame(blocks)])
        plan = plan_ops(reply, arrays, "save")
        stored = reply.skipped_blocks + reply.stored_blocks + reply.in_flight_blocks
        return self._link.layered(plan, stored * self._tokens_per_block)

    def execute_layered(self, plan: PlanOps) -> LayeredTransfer:
        """`execute`, layer by layer: this rank's part of another rank's plan."""
        return self._link.layered(plan, 0)

    def execute(self, plan: PlanOps) -> TransferHandle:
        """Run this rank's part of a plan another rank of the engine asked for.
        SidecarUnavailable if the sidecar that made it has restarted since:
        nothing is copied, and the plan died with that sidecar. ValueError,
        with nothing copied, if this rank ran or gave back the plan already."""
        return self._link.run(plan, 0)

    def cancel(self, plan: PlanOps) -> None:
        """Tell the sidecar this rank will never run `plan` (another rank of
        the engine asked for it, and it came too late): the plan is rolled
        back. Best effort: a restarted sidecar took its plans along."""
        if plan.boot_id == self._link.boot_id:
            self._link.give_back(plan.plan_id)

    def exists(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> bool:
        """Whether every full block of `token_ids` is cached."""
        keys = self._keys(token_ids)
        reply, _ = self._link.call(self._link.req(p.Exists), [p.keys_frame(keys)])
        return bool(reply.exists)

    def delete(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> int:
        """Drop the last full block of `token_ids` and every cached block that
        extends it; returns blocks dropped. SidecarError(BUSY) if in use."""
        keys = self._keys(token_ids)
        reply, _ = self._link.call(self._link.req(p.Delete), [p.keys_frame(keys)])
        return int(reply.deleted_blocks)

    def stats(self) -> dict[str, Any]:
        """The sidecar's figures (what this client did through the hot index
        is sent first, so they count it)."""
        self._link.hot.send_touch()
        reply, _ = self._link.channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        return reply.stats  # type: ignore[no-any-return]

    def close(self) -> None:
        """Unregister (best effort), stop heartbeats, unmap the shm. Idempotent.
        Not while another thread uses this client (a client is one thread's)."""
        self._link.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ------------------------------------------------------------------------------

    def _hot_flags(self) -> int:
        """The hot index's flags while this client may use it, else 0."""
        return self._link.hot_flags(self.hot_path)

    @property
    def _hasher(self) -> KeyHasher:
        """The key hasher of the registered namespace."""
        return self._link.registration().hasher

    @property
    def _tokens_per_block(self) -> int:
        return self._hasher.tokens_per_block

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
