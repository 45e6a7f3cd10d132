"""What `router proxy` decides: which engine serves a prompt of these tokens.

One `Router` index holds every engine's blocks, fed by an `EventPump`
thread (the ZMQ subscriptions, and the sweep of stale entries between
messages); the HTTP side picks under the same lock. Tokens become keys in
up to two ways: the sidecars' namespace hasher (engines behind a kvsidecar
publish those keys) and the proxy's own token hasher for vLLM's events
(router/vllm_tokens.py). The cost is `WorkerSelector`'s: blocks still to
prefill times the overlap weight, plus the prompt blocks of the requests
in flight on that engine. An engine that refused a connection is left out
for `down_seconds`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np
import zmq

from contract.blocks import KeyHasher
from contract.endpoint import CurveClientKeys
from router.choice import NoWorkers
from router.index import OverlapScores
from router.keys import BlockKey, Worker, split_keys, worker
from router.router import Router
from router.subscriber import Subscriptions
from router.upstreams import Upstream, WorkerSpec
from router.vllm_tokens import TokenKeyer

MAX_DRAIN = 1024
"""Messages read from one source before the others (and a sweep) get a turn."""
DRAIN_STEP = 16


class Routed(NamedTuple):
    upstream: Upstream
    blocks: int
    """Full blocks of the prompt."""
    overlap: int
    """Of them, those the engine already holds."""


class EventPump:
    """A thread that applies KV events to `router` (under `lock`) and sweeps
    stale index entries when it has nothing else to do."""

    def __init__(
        self,
        router: Router,
        lock: threading.Lock,
        specs: Sequence[WorkerSpec],
        token_keys: TokenKeyer | None,
        worker_timeout: float,
        curve: CurveClientKeys | None,
    ) -> None:
        self.router = router
        self.lock = lock
        self.ctx = zmq.Context()
        sources = [s.source for s in specs if s.source is not None]
        try:
            self.subs = Subscriptions(
                self.ctx,
                router,
                sources,
                worker_timeout=worker_timeout,
                curve=curve,
                token_keys=token_keys,
            )
        except zmq.ZMQError:
            self.ctx.term()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.subs.sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            with self.lock:
                self.subs.resync_all()
            while not self._stop.is_set():
                sweeping = self.router.index.stale_blocks > 0
                wait_ms = 0 if sweeping else 100
                if self.subs.sockets:
                    ready = dict(poller.poll(wait_ms))
                else:  # an empty poll returns at once: wait here, not spin
                    ready = {}
                    self._stop.wait(wait_ms / 1000)
                for sock in self.subs.sockets:
                    if sock in ready:
                        self._drain(sock)
                with self.lock:
                    self.subs.expire()
                    if sweeping:
                        self.router.sweep()
        finally:
            self.subs.close()
            self.ctx.term()

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        """Up to MAX_DRAIN messages, the lock taken per DRAIN_STEP of them, so
        that a request waits for a few messages at most, not a flood."""
        for _ in range(MAX_DRAIN // DRAIN_STEP):
            with self.lock:
                self.subs.drain(sock, DRAIN_STEP)
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                break


class ProxyRouting:
    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        router: Router,
        *,
        sidecar_keys: KeyHasher | None = None,
        vllm_keys: KeyHasher | None = None,
        down_seconds: float = 5.0,
        worker_timeout: float = 10.0,
        curve: CurveClientKeys | None = None,
    ) -> None:
        """`sidecar_keys`: the sidecars' hasher (needed if a worker has
        sidecar= events); `vllm_keys`: the hasher vLLM blocks are keyed by
        from their tokens (needed if one has vllm= events)."""
        kinds = {s.kind for s in specs}
        if "sidecar" in kinds and sidecar_keys is None:
            raise ValueError("workers with sidecar= events need the sidecars' --namespace")
        if "vllm" in kinds and vllm_keys is None:
            raise ValueError("workers with vllm= events need a token hasher (--tokenizer)")
        self.router = router
        self.lock = threading.Lock()
        self.upstreams = {s.worker_id: Upstream(s) for s in specs}
        self.hashers = [
            h
            for h, kind in ((sidecar_keys, "sidecar"), (vllm_keys, "vllm"))
            if kind in kinds and h is not None  # (checked above: given where needed)
        ]
        self.down_seconds = down_seconds
        self.counts: Counter[str] = Counter()
        for s in specs:
            router.add_worker(worker(s.worker_id))
        keyer = TokenKeyer(vllm_keys) if vllm_keys is not None else None
        self.token_keys = keyer
        self.events = EventPump(router, self.lock, specs, keyer, worker_timeout, curve)

    def keys(self, tokens: Sequence[int]) -> list[list[BlockKey]]:
        """The prompt's block keys under each hasher in use."""
        ids = np.asarray(tokens, dtype=np.int64)
        return [split_keys(h.hash_tokens(ids).tobytes()) for h in self.hashers]

    def pick(self, tokens: Sequence[int], exclude: Collection[int] = ()) -> Routed:
        """The engine for a prompt of `tokens` among those up and not in
        `exclude` (NoWorkers if none is left). Records the hit figures."""
        try:
            families = self.keys(tokens)
        except (ValueError, OverflowError):  # an id out of the hashers' range: route by load
            self.counts["unhashable_prompts"] += 1
            families = []
        now = time.monotonic()
        pool = [u for wid, u in self.upstreams.items() if wid not in exclude and u.up(now)]
        if not pool:
            raise NoWorkers("no engine is up")
        n_blocks = max((len(k) for k in families), default=0)
        with self.lock:
            overlap: dict[Worker, int] = {}
            for keys in families:
                for w, n in self.router.find_matches(keys).scores.items():
                    me = worker(w.worker_id)
                    overlap[me] = max(overlap.get(me, 0), n)
            sizes: Counter[Worker] = Counter()
            for w, n in self.router.index.workers().items():
                sizes[worker(w.worker_id)] += n
            cands = [worker(u.spec.worker_id) for u in pool]
            scores = OverlapScores(overlap, {w: sizes[w] for w in cands})
            loads = {worker(u.spec.worker_id): u.in_flight_blocks for u in pool}
            choice = self.router.selector.select(scores, n_blocks, cands, loads)
            self.router.stats.record(choice.worker, n_blocks, choice.overlap)
        return Routed(self.upstreams[choice.worker.worker_id], n_blocks, choice.overlap)

    def begin(self, routed: Routed) -> None:
        routed.upstream.in_flight += 1
        routed.upstream.in_flight_blocks += max(routed.blocks, 1)

    def end(self, routed: Routed) -> None:
        routed.upstream.in_flight -= 1
        routed.upstream.in_flight_blocks -= max(routed.blocks, 1)

    def mark_down(self, upstream: Upstream) -> None:
        upstream.failures += 1
        upstream.down_until = time.monotonic() + self.down_seconds

    def blocks(self) -> dict[int, int]:
        """Blocks the index holds per engine (all its ranks)."""
        out = dict.fromkeys(self.upstreams, 0)
        with self.lock:
            for w, n in self.router.index.workers().items():
                if w.worker_id in out:
                    out[w.worker_id] += n
        return out

    def event_counts(self) -> dict[str, int]:
        with self.lock:
            return dict(self.events.subs.counts) | {"applied": self.router.events_applied}

    def start(self) -> None:
        self.events.start()

    def close(self) -> None:
        self.events.stop()


__all__ = ["NoWorkers", "ProxyRouting", "Routed"]
