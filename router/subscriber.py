"""Subscriptions: the router's SUB sockets to sidecars and vLLM engines.

Per sidecar source, the subscriber tracks (epoch, seq). A batch that does
not follow the last one (a gap, a restart, a late join) triggers a resync: a
full dump from the source's resync endpoint replaces that worker's blocks,
and batches the dump already covers are skipped. Without a resync endpoint,
or when the resync fails, the worker's blocks are cleared instead: the router
then under-estimates overlap for a while, which is safe, rather than routing
on blocks that may be gone.

After a failed resync the source is followed like one without a resync
endpoint (stores continuing a block lost in the gap are skipped one by one)
and no other resync is tried for `resync_retry` seconds: a dead endpoint
must not block the router for a timeout on every batch.

vLLM sources have no dump; on a gap their worker is cleared the same way.
Their blocks are keyed by vLLM's hashes, or, given a `TokenKeyer`, by their
tokens (router/vllm_tokens.py: what `router proxy` matches prompts against).
These clears, the subscriber's own, cover the one rank whose stream broke; a
Cleared event (vLLM's AllBlocksCleared) from any rank clears every rank of
its worker id, and forgetting a worker forgets every rank, as in Dynamo.
Malformed messages are counted and dropped; they never change the index.

Liveness: a sidecar publishes a heartbeat (a batch with no events, carrying
the seq of its last batch) every second when it has nothing else to send.
A sidecar source silent for `worker_timeout` seconds (dead, killed, or cut
off) has its worker forgotten; its next message resyncs it. A source that
starts publishing as another worker id (restarted with a new
events_worker_id) has its old worker forgotten at once. A worker id is
followed from one source only: batches of a second source naming it are
counted (`worker_conflicts`) and dropped, never merged. vLLM engines send
no heartbeats: their workers are never expired.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from contract import events as wire
from contract.endpoint import CurveClientKeys, apply_curve
from contract.events import RouterEvent, WireError
from router.dump import RouterIndexError
from router.keys import Worker, worker
from router.router import Router
from router.vllm_events import VllmBatch, decode_vllm
from router.vllm_tokens import TokenKeyer, Untokenized

log = logging.getLogger("kvsidecar.router")


@dataclass(frozen=True)
class Source:
    endpoint: str
    """PUB endpoint to connect to."""
    resync_endpoint: str | None = None
    """Sidecar only: its events_resync_endpoint."""
    vllm_worker_id: int | None = None
    """Set for a vLLM engine (whose events carry no worker id); None: a sidecar."""


@dataclass
class _State:
    source: Source
    sock: zmq.Socket[bytes]
    epoch: str | None = None
    seq: int = -1
    resync_after: float = 0.0
    """time.monotonic() before which no resync is tried (one just failed)."""
    left_epoch: str | None = None
    """An epoch a dump showed the publisher has left (it restarted): batches of
    it still queued are dropped without another resync each."""
    worker: Worker | None = None
    """The worker this sidecar source publishes as (None: none yet, or expired)."""
    last_seen: float = 0.0
    """time.monotonic() of the source's last message."""
    conflict_logged: bool = False


class Subscriptions:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        router: Router,
        sources: list[Source],
        resync_timeout: float = 2.0,
        resync_retry: float = 30.0,
        worker_timeout: float = 10.0,
        curve: CurveClientKeys | None = None,
        token_keys: TokenKeyer | None = None,
    ) -> None:
        """`worker_timeout`: seconds of silence after which a sidecar
        source's worker is forgotten (0: never). `curve`: the keys for
        sidecars whose tcp:// events and resync endpoints require CURVE
        (applied to every tcp:// source). `token_keys`: key vLLM sources'
        blocks by their tokens (default: by vLLM's hashes)."""
        if not worker_timeout >= 0:
            raise ValueError(f"worker_timeout must be >= 0, got {worker_timeout}")
        self.ctx = ctx
        self.router = router
        self.resync_timeout = resync_timeout
        self.resync_retry = resync_retry
        self.worker_timeout = worker_timeout
        self.curve = curve
        self.token_keys = token_keys
        self.counts: Counter[str] = Counter()
        self._states: dict[zmq.Socket[bytes], _State] = {}
        self._owners: dict[Worker, _State] = {}
        """Which source each worker's events come from."""
        try:
            for src in sources:
                sock = ctx.socket(zmq.SUB)
                self._states[sock] = _State(src, sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 100_000)
                topic = b"" if src.vllm_worker_id is not None else wire.TOPIC
                sock.setsockopt(zmq.SUBSCRIBE, topic)
                self._secure(sock, src.endpoint)
                sock.connect(src.endpoint)
                if src.resync_endpoint is not None:
                    _check_endpoint(ctx, src.resync_endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    @property
    def sockets(self) -> list[zmq.Socket[bytes]]:
        return list(self._states)

    def drain(self, sock: zmq.Socket[bytes], max_messages: int = 1000) -> None:
        """Handle the messages waiting on `sock` (one of `sockets`), at most
        `max_messages`: a publisher sending without pause must not keep the
        caller from its other sockets (router serve's queries)."""
        st = self._states[sock]
        for _ in range(max_messages):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                break
            frames = sock.recv_multipart(zmq.NOBLOCK)
            try:
                if st.source.vllm_worker_id is None:
                    self._on_sidecar(st, frames)
                else:
                    self._on_vllm(st, frames)
            except WireError as exc:
                self.counts["bad_messages"] += 1
                log.warning("dropped a message from %s: %s", st.source.endpoint, exc)
            except Exception:  # a bug must not take the router down: drop the message
                self.counts["bad_messages"] += 1
                log.exception("dropped a message from %s", st.source.endpoint)

    def expire(self, now: float | None = None) -> None:
        """Forget the workers of sidecar sources silent for worker_timeout."""
        if not self.worker_timeout:
            return
        now = time.monotonic() if now is None else now
        for st in self._states.values():
            if st.worker is not None and now - st.last_seen > self.worker_timeout:
                log.warning(
                    "no message from %s for %.0f s: forgetting worker %s",
                    st.source.endpoint,
                    now - st.last_seen,
                    st.worker,
                )
                self._forget(st)
                st.epoch = None  # its next message resyncs it
                self.counts["workers_expired"] += 1

    def resync_all(self) -> None:
        """Dump every sidecar source now (at start: a router joining late)."""
        for st in self._states.values():
            if st.source.vllm_worker_id is None and st.source.resync_endpoint is not None:
                self._resync(st)

    def close(self) -> None:
        for sock in self._states:
            sock.close(0)
        self._states.clear()

    # ---- sidecars ------------------------------------------------------------

    def _claim(self, st: _State, w: Worker) -> bool:
        """Make `w` the worker of sidecar source `st`: False (and the message
        dropped) if another source publishes as `w`. A source that changes
        worker id has its old worker forgotten."""
        owner = self._owners.get(w)
        if owner is not None and owner is not st:
            self.counts["worker_conflicts"] += 1
            if not st.conflict_logged:
                st.conflict_logged = True
                log.warning(
                    "%s publishes as worker %s, which %s already does: its events are "
                    "dropped (give every sidecar its own events_worker_id)",
                    st.source.endpoint,
                    w,
                    owner.source.endpoint,
                )
            return False
        if st.worker is not None and st.worker != w:
            self._forget(st)
        st.worker = w
        self._owners[w] = st
        return True

    def _forget(self, st: _State) -> None:
        assert st.worker is not None
        self.router.remove_worker(st.worker.worker_id)
        self._owners.pop(st.worker, None)
        st.worker = None

    def _on_sidecar(self, st: _State, frames: list[bytes]) -> None:
        if len(frames) != 2 or frames[0] != wire.TOPIC:
            raise WireError(f"expected 2 frames [{wire.TOPIC!r}, batch]")
        batch = wire.decode_batch(frames[1])
        events = wire.to_events(batch.events)
        w = worker(batch.worker_id, batch.dp_rank)
        st.last_seen = time.monotonic()
        if not self._claim(st, w):
            return
        beat = not events  # a heartbeat: "nothing since batch `seq`"
        self.counts["heartbeats" if beat else "batches"] += 1
        step = 0 if beat else 1
        if batch.epoch == st.epoch and batch.seq < st.seq + step:
            return  # already covered by a dump
        if batch.epoch == st.left_epoch:
            return  # sent before the publisher restarted
        if batch.epoch != st.epoch or batch.seq != st.seq + step:
            self.counts["gaps"] += 1
            if not self._resync(st):
                self.router.clear_rank(w)  # no dump: forget, start over
                st.epoch, st.seq = batch.epoch, batch.seq - step
            elif batch.epoch != st.epoch:
                st.left_epoch = batch.epoch
            if batch.epoch != st.epoch or batch.seq != st.seq + step or beat:
                return
        if beat:
            return
        if st.source.resync_endpoint is None or time.monotonic() < st.resync_after:
            self._apply_each(st, w, events)
        elif not self._apply(st, w, events):
            return
        st.seq = batch.seq

    def _resync(self, st: _State) -> bool:
        """Replace the source's blocks by its dump; False if there is none."""
        if st.source.resync_endpoint is None or time.monotonic() < st.resync_after:
            return False
        reply = self._request_dump(st.source.resync_endpoint)
        try:
            if not isinstance(reply, wire.DumpReply):
                raise WireError("no dump")
            runs = wire.to_events(list(reply.runs))
        except WireError as exc:
            self.counts["resync_failures"] += 1
            st.resync_after = time.monotonic() + self.resync_retry
            log.warning("resync from %s failed: %s", st.source.resync_endpoint, exc)
            return False
        w = worker(reply.worker_id, reply.dp_rank)
        if not self._claim(st, w):
            return False
        self.router.clear_rank(w)  # the dump replaces this rank's blocks
        if not self._apply(st, w, runs):
            self.counts["resync_failures"] += 1
            st.resync_after = time.monotonic() + self.resync_retry
            return False
        st.epoch, st.seq = reply.epoch, reply.seq
        st.last_seen = time.monotonic()
        self.counts["resyncs"] += 1
        return True

    def _secure(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        if self.curve is not None and endpoint.startswith("tcp://"):
            apply_curve(sock, self.curve)

    def _request_dump(self, endpoint: str | None) -> wire.DumpReply | wire.ErrorReply | None:
        if endpoint is None:
            return None
        req = self.ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        try:
            self._secure(req, endpoint)
            req.connect(endpoint)
            req.send(wire.DUMP_REQUEST)
            if not req.poll(int(self.resync_timeout * 1000)):
                log.warning("resync from %s timed out", endpoint)
                return None
            reply = wire.decode_reply(req.recv())
            if isinstance(reply, wire.ErrorReply):
                log.warning("resync from %s refused: %s", endpoint, reply.message)
            return reply
        except (WireError, zmq.ZMQError) as exc:
            log.warning("resync from %s: %s", endpoint, exc)
            return None
        finally:
            req.close(0)

    def _apply(self, st: _State, w: Worker, events: list[RouterEvent]) -> bool:
        """Apply a batch; on an index error, clear the worker (its state is no
        longer known) and resync at the next batch."""
        try:
            self.router.apply(w, events)
            self.counts["events"] += len(events)
            return True
        except RouterIndexError as exc:
            self.counts["rejected_batches"] += 1
            log.warning("worker %s: %s; clearing it", w, exc)
            self.router.clear_rank(w)
            st.epoch = None
            return False

    def _apply_each(self, st: _State, w: Worker, events: list[RouterEvent]) -> None:
        """Without a dump to fall back on, each event stands alone: one the
        index rejects (a store continuing a block lost in a gap) is skipped."""
        for event in events:
            try:
                self.router.apply(w, [event])
                self.counts["events"] += 1
            except RouterIndexError:
                self.counts["rejected_events"] += 1

    # ---- vLLM engines --------------------------------------------------------

    def _on_vllm(self, st: _State, frames: list[bytes]) -> None:
        batch = decode_vllm(frames)
        assert st.source.vllm_worker_id is not None
        w = worker(st.source.vllm_worker_id, batch.dp_rank)
        owner = self._owners.setdefault(w, st)
        if owner is not st:
            self.counts["worker_conflicts"] += 1
            return
        self.counts["batches"] += 1
        if st.seq >= 0 and batch.seq != st.seq + 1:  # lost batches, or a restart (from 0)
            self.counts["gaps"] += 1
            self.router.clear_rank(w)
            if self.token_keys is not None:
                self.token_keys.clear_rank(w)
        st.seq = batch.seq
        if self.token_keys is None:
            self._apply_each(st, w, batch.events)
        else:
            self._apply_tokens(self.token_keys, w, batch)

    def _apply_tokens(self, keyer: TokenKeyer, w: Worker, batch: VllmBatch) -> None:
        """Apply each event keyed by tokens; one that cannot be keyed, or that
        the index rejects, is skipped and counted."""
        for event, tokens in zip(batch.events, batch.tokens, strict=True):
            try:
                keyed = keyer.translate(w, event, tokens)
                self.router.apply(w, [keyed])
            except Untokenized:
                self.counts["untokenized_events"] += 1
                continue
            except RouterIndexError:
                self.counts["rejected_events"] += 1
                continue
            keyer.commit(w, event, keyed)
            self.counts["events"] += 1


def _check_endpoint(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
    """ZMQError now, at start, if `endpoint` cannot be connected to at all."""
    probe = ctx.socket(zmq.REQ)
    try:
        probe.connect(endpoint)
    finally:
        probe.close(0)
