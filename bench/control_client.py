"""What runs inside the processes of `kvsidecar bench control`.

`ControlClient` is one engine-like client (a `bench.fleet` state): a raw
DEALER for the ping-pong floor, and against the sidecar a registered
`KVClient` plus a raw protocol `Channel` on the same session. `echo_main`
is the floor's server: a ROUTER that answers each request, without decoding
it, with a reply of the size the sidecar would send. The floor's two ends
send with `protocol.send_frames`, the sidecar's and the shim's own send, so
the floor and the sidecar differ only in what the sidecar does.

The KV layout is tiny on purpose (1 layer, 128 B per block), so the bytes a
full load or save copies through shm are negligible next to the control path.
Every request is checked once (warm-up) for the hits or stores it should
get, so a figure never silently times a miss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from bench.fleet import Samples, Timing, timed_loop, timed_rotation
from contract import protocol as p
from contract.blocks import KeyHasher, Namespace
from engine_shim.channel import Channel

TOKENS_PER_BLOCK = 16
BLOCK_SHAPE = (2, TOKENS_PER_BLOCK, 1, 1)  # K/V x tokens x heads x head_dim, fp32
BLOCK_BYTES = 4 * int(np.prod(BLOCK_SHAPE))
MODEL = {
    "model_name": "bench-control",
    "model_revision": "0",
    "tokens_per_block": TOKENS_PER_BLOCK,
    "num_kv_heads": 1,
    "head_dim": 1,
}
NAMESPACE = Namespace(
    model_name=MODEL["model_name"],
    model_revision=MODEL["model_revision"],
    layout="paged",
    dtype="float32",
    tp_size=1,
    num_layers=1,
    num_kv_heads=1,
    head_dim=1,
    tokens_per_block=TOKENS_PER_BLOCK,
)
"""The namespace KVClient.register derives from MODEL and the KV tensors above."""

LOOKUP_SET = 0
"""Token-sequence seed of the blocks pre-saved for lookups and loads; client i
saves sequence i + 1, so concurrent saves never share a block."""


def token_ids(num_blocks: int, seed: int) -> np.ndarray:
    """A prompt of `num_blocks` full blocks; sequences of different seeds share no block."""
    return np.arange(num_blocks * TOKENS_PER_BLOCK, dtype=np.int64) + seed * 10_000_000


def request_frames(header_bytes: int, num_blocks: int, with_ids: bool) -> list[bytes]:
    """Frames of the sizes of a lookup (header + keys) or load/save (+ ids) request."""
    frames = [bytes(header_bytes), bytes(num_blocks * p.KEY_DTYPE.itemsize)]
    if with_ids:
        frames.append(bytes(num_blocks * p.ID_DTYPE.itemsize))
    return frames


def echo_main(endpoint: str, lookup_reply: int, plan_reply: int, ready: Any) -> None:
    """Answer [id, header, keys] and [id, header] (a Complete) with [id,
    lookup_reply bytes], and [id, header, keys, ids] with [id, plan_reply
    bytes, src ids, dst ids], until terminated."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    ready.send(True)
    replies: dict[tuple[int, int], list[bytes]] = {}
    while True:
        frames = sock.recv_multipart()
        shape = (len(frames), len(frames[2]) if len(frames) > 2 else 0)
        reply = replies.get(shape)
        if reply is None:
            ids = bytes(shape[1] // p.KEY_DTYPE.itemsize * p.ID_DTYPE.itemsize)
            reply = [bytes(plan_reply), ids, ids] if shape[0] == 4 else [bytes(lookup_reply)]
            replies[shape] = reply
        p.send_frames(sock, [frames[0], *reply])


class ControlClient:
    """One client process's state; task methods are called through `bench.fleet`."""

    def __init__(self) -> None:
        import torch  # imported while the sidecar starts, not in the first task

        from engine_shim.client import KVClient

        self._torch, self._kv_client = torch, KVClient
        self.index = 0
        self.hasher = KeyHasher(NAMESPACE)
        self.kv: Any = None  # KVClient, once connected
        self.channel: Channel | None = None
        self.session = ""
        self._dealers: dict[str, zmq.Socket] = {}

    # ---- the floor ---------------------------------------------------------------

    def ping(
        self, sync, endpoint: str, header_bytes: int, blocks: int, with_ids: bool, timing: Timing
    ) -> Samples:
        """Raw DEALER -> echo ROUTER round trips of request-sized messages."""
        return timed_loop(self._ping_step(endpoint, header_bytes, blocks, with_ids), timing, sync)

    def ping_full(
        self,
        sync,
        endpoint: str,
        header_bytes: int,
        complete_bytes: int,
        blocks: int,
        timing: Timing,
    ) -> Samples:
        """The two round trips of a full load or save: a plan-sized ping-pong,
        then one of a Complete (a header) and its ack (a small header)."""
        plan = self._ping_step(endpoint, header_bytes, blocks, with_ids=True)
        sock = self._dealers[endpoint]
        complete = [bytes(complete_bytes)]

        def step() -> None:
            plan()
            p.send_frames(sock, complete)
            sock.recv_multipart()

        return timed_loop(step, timing, sync)

    def _ping_step(
        self, endpoint: str, header_bytes: int, blocks: int, with_ids: bool
    ) -> Callable[[], None]:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._dealers[endpoint] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        frames = request_frames(header_bytes, blocks, with_ids)

        def step() -> None:
            p.send_frames(sock, frames)
            sock.recv_multipart()

        return step

    # ---- the sidecar -------------------------------------------------------------

    def connect(self, sync, endpoint: str, index: int, gpu_blocks: int) -> str:
        """Register a KVClient with the tiny layout; returns its session id."""
        self.index = index
        kv = [self._torch.zeros((gpu_blocks, *BLOCK_SHAPE), dtype=self._torch.float32)]
        # The control plane is what this bench times: every call asks the
        # sidecar. (The hot index answers CPU-tier lookups and loads in the
        # engine's process, without a round trip: `bench.control_calls`.)
        self.kv = self._kv_client.connect(endpoint, timeout=10.0, hot_path=False)
        self.kv.register(kv, **MODEL)
        self.session = self.kv.session
        self.channel = Channel(endpoint, 10.0)
        return self.session

    def sidecar_requests(self, sync) -> dict[str, int]:
        """The requests the sidecar has answered so far, by kind (its stats):
        what shows that the timed calls asked it."""
        return dict(self.kv.stats()["requests"])

    def presave(self, sync, blocks: int) -> int:
        """Save the lookup set (untimed); returns the tokens cached."""
        return int(self.kv.save(token_ids(blocks, LOOKUP_SET), np.arange(blocks)).wait())

    def hash(self, sync, blocks: int, timing: Timing) -> Samples:
        tokens = token_ids(blocks, LOOKUP_SET)
        return timed_loop(lambda: self.hasher.hash_tokens(tokens), timing, sync)

    def lookup(self, sync, blocks: int, timing: Timing) -> Samples:
        """KVClient.lookup: hashing the tokens, then one Lookup round trip."""
        tokens = token_ids(blocks, LOOKUP_SET)
        _expect("lookup", self.kv.lookup(tokens), blocks * TOKENS_PER_BLOCK)
        return timed_loop(lambda: self.kv.lookup(tokens), timing, sync)

    def lookup_paired(
        self, sync, echo: str, header_bytes: int, blocks: int, timing: Timing
    ) -> dict[str, Samples]:
        """The three terms of the lookup target side by side (`timed_rotation`):
        the raw ping-pong of lookup sizes, hashing the tokens, and
        KVClient.lookup of the same tokens; and a fourth, the same raw
        ping-pong timed right after an untimed hashing of the tokens, as
        KVClient.lookup sends right after hashing (on these VMs a round trip
        after ~0.5 ms of one-sided work costs more than one back to back:
        the other processes' threads have gone to sleep)."""
        tokens = token_ids(blocks, LOOKUP_SET)
        _expect("lookup", self.kv.lookup(tokens), blocks * TOKENS_PER_BLOCK)
        floor = self._ping_step(echo, header_bytes, blocks, with_ids=False)
        steps = {
            "floor": floor,
            "hash": lambda: self.hasher.hash_tokens(tokens),
            "lookup": lambda: self.kv.lookup(tokens),
            "floor_after_hash": floor,
        }
        before = {"floor_after_hash": lambda: self.hasher.hash_tokens(tokens)}
        return timed_rotation(steps, timing, sync, before)

    def lookup_keys(self, sync, blocks: int, timing: Timing) -> Samples:
        """A Lookup of pre-hashed keys over the raw protocol."""
        keys = self.hasher.hash_tokens(token_ids(blocks, LOOKUP_SET))

        def step() -> Any:
            return self._call(p.Lookup, [p.keys_frame(keys)])

        _expect("lookup of pre-hashed keys", step().num_blocks, blocks)
        return timed_loop(step, timing, sync)

    def load_plan(self, sync, blocks: int, timing: Timing) -> Samples:
        """Load -> plan reply over the raw protocol; each plan is cancelled untimed."""
        keys = self.hasher.hash_tokens(token_ids(blocks, LOOKUP_SET))
        return self._plan(p.Load, keys, "hit_blocks", blocks, timing, sync)

    def save_plan(self, sync, blocks: int, timing: Timing) -> Samples:
        """Save -> plan reply over the raw protocol for blocks the sidecar lacks;
        each plan is cancelled untimed, which drops its unlanded blocks."""
        keys = self.hasher.hash_tokens(token_ids(blocks, self.index + 1))
        return self._plan(p.Save, keys, "stored_blocks", blocks, timing, sync)

    def load_full(self, sync, blocks: int, timing: Timing) -> Samples:
        """KVClient.load(...).wait(): hash, plan, copy shm -> KV, Complete, ack."""
        tokens, ids = token_ids(blocks, LOOKUP_SET), np.arange(blocks)

        def step() -> int:
            return int(self.kv.load(tokens, ids).wait())

        _expect("load", step(), blocks * TOKENS_PER_BLOCK)
        return timed_loop(step, timing, sync)

    def save_full(self, sync, blocks: int, timing: Timing) -> Samples:
        """KVClient.save(...).wait(): hash, plan, copy KV -> shm, Complete, ack;
        the saved blocks are deleted untimed, so the next save stores them again."""
        tokens, ids = token_ids(blocks, self.index + 1), np.arange(blocks)
        first_block = tokens[:TOKENS_PER_BLOCK]

        def step() -> int:
            return int(self.kv.save(tokens, ids).wait())

        def forget(_: int) -> None:
            self.kv.delete(first_block)  # the first block and every block extending it

        _expect("save", step(), blocks * TOKENS_PER_BLOCK)
        forget(0)
        return timed_loop(step, timing, sync, after=forget)

    # ---- helpers ---------------------------------------------------------------------

    def _call(self, kind: type, arrays: list[bytes], **fields: Any) -> Any:
        """The typed reply (`contract.replies`) to one raw request."""
        assert self.channel is not None
        request = kind(v=p.PROTOCOL_VERSION, id=0, session=self.session, **fields)
        return self.channel.call(request, arrays)[0]

    def _plan(self, kind: type, keys: np.ndarray, field: str, blocks: int, timing, sync):
        ids = np.arange(blocks)

        def step() -> Any:
            return self._call(kind, [p.keys_frame(keys), p.ids_frame(ids)])

        def cancel(reply: Any) -> None:
            self._call(p.Cancel, [], plan_id=reply.plan_id)

        reply = step()
        _expect(f"{kind.__name__.lower()} plan", getattr(reply, field), blocks)
        cancel(reply)
        return timed_loop(step, timing, sync, after=cancel)

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(0)
        self._dealers.clear()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.kv is not None:
            self.kv.close()
            self.kv = None


def _expect(what: str, got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"{what} gave {got}, expected {want}: the benchmark would time a miss")
