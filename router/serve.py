"""`kvsidecar router serve`: the router as a process.

One thread polls a REP socket (queries) and the SUB sockets of every
source (KV events). Requests and replies are msgpack maps:

    {"op": "route", "keys": <16-byte keys concatenated>}      sidecar keys
    {"op": "route", "tokens": [int, ...]}                      needs --namespace
    {"op": "route", "vllm_hashes": [int | bytes, ...]}         vLLM block hashes
        optional: "loads": [[worker_id, dp_rank, decode_blocks], ...],
                  "candidates": [[worker_id, dp_rank], ...]
    -> {"ok": true, "worker_id", "dp_rank", "overlap", "cost", "request_blocks",
        "scores": [[worker_id, dp_rank, overlap], ...]}
    {"op": "match", <one of the key fields>} -> {"ok": true, "scores", "tree_sizes"}
    {"op": "stats"} -> {"ok": true, "index": {...}, "events": {...}, "hits": {...}}

Anything malformed gets {"ok": false, "error": "<what is wrong>"} and changes
nothing.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import msgspec
import zmq

from contract.endpoint import CurveClientKeys
from router.choice import NoWorkers
from router.keys import BlockKey, Worker, split_keys, vllm_keys, worker
from router.router import Router
from router.subscriber import Source, Subscriptions

log = logging.getLogger("kvsidecar.router")

MAX_REQUEST_BYTES = 16 << 20
"""A larger request is answered with an error, unread."""
MAX_FRAME_BYTES = 256 << 20
"""ZeroMQ drops a larger frame and its connection unanswered: the router
never buffers more than this for one request."""


class _Keyed(msgspec.Struct, forbid_unknown_fields=True, tag_field="op"):
    keys: bytes | None = None
    tokens: list[int] | None = None
    vllm_hashes: list[int | bytes] | None = None


class RouteRequest(_Keyed, tag="route"):
    loads: list[tuple[int, int, int]] = []
    candidates: list[tuple[int, int]] | None = None


class MatchRequest(_Keyed, tag="match"):
    pass


class StatsRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="op", tag="stats"):
    pass


Request = RouteRequest | MatchRequest | StatsRequest
_decoder = msgspec.msgpack.Decoder(Request)
_encoder = msgspec.msgpack.Encoder()


class BadRequest(ValueError):
    pass


class RouterServer:
    def __init__(
        self,
        router: Router,
        bind: str,
        sources: list[Source],
        worker_timeout: float = 10.0,
        curve: CurveClientKeys | None = None,
    ) -> None:
        """`curve`: the keys for sidecars whose events require CURVE."""
        self.router = router
        self.ctx = zmq.Context()
        self.rep = self.ctx.socket(zmq.REP)
        self.rep.setsockopt(zmq.LINGER, 0)
        self.rep.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            self.rep.bind(bind)
            self.subs = Subscriptions(
                self.ctx, router, sources, worker_timeout=worker_timeout, curve=curve
            )
        except zmq.ZMQError:  # a bad endpoint: release the socket and context
            self.rep.close(0)
            self.ctx.term()
            raise
        self.endpoint = self.rep.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.rep, zmq.POLLIN)
        for sock in self.subs.sockets:
            self.poller.register(sock, zmq.POLLIN)
        self.stopping = False
        self.errors = 0

    def serve_forever(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        self.subs.resync_all()
        try:
            while not self.stopping:
                self.poll_once()
        finally:
            self.close()

    def poll_once(self, timeout_ms: int = 100) -> None:
        """Handle what is ready; with stale index entries left (a cleared or
        removed worker), sweep one bounded slice of them instead of waiting."""
        sweeping = self.router.index.stale_blocks > 0
        ready = dict(self.poller.poll(0 if sweeping else timeout_ms))
        for sock in self.subs.sockets:  # events first: answers see the latest state
            if sock in ready:
                self.subs.drain(sock)
        self.subs.expire()
        if self.rep in ready:
            frames = self.rep.recv_multipart()  # all of them, or REP cannot reply
            if len(frames) == 1:
                reply = self.handle(frames[0])
            else:
                self.errors += 1
                reply = {"ok": False, "error": f"expected 1 frame, got {len(frames)}"}
            self.rep.send(_encoder.encode(reply))
        if sweeping:
            self.router.sweep()

    def handle(self, payload: bytes) -> dict[str, Any]:
        if len(payload) > MAX_REQUEST_BYTES:
            self.errors += 1
            return {
                "ok": False,
                "error": f"request of {len(payload)} bytes is over {MAX_REQUEST_BYTES} bytes",
            }
        try:
            req = _decoder.decode(payload)
            if isinstance(req, StatsRequest):
                return {"ok": True, **self.stats()}
            keys = self._keys(req)
            if isinstance(req, MatchRequest):
                scores = self.router.find_matches(keys)
                return {
                    "ok": True,
                    "scores": _rows(scores.scores),
                    "tree_sizes": _rows(scores.tree_sizes),
                }
            return self._route(req, keys)
        except (msgspec.DecodeError, BadRequest, NoWorkers, ValueError) as exc:
            self.errors += 1
            return {"ok": False, "error": str(exc)}
        except Exception as exc:  # a bug must not leave the REP socket unanswered
            log.exception("request failed")
            self.errors += 1
            return {"ok": False, "error": f"internal error: {exc!r}"}

    def _route(self, req: RouteRequest, keys: list[BlockKey]) -> dict[str, Any]:
        loads = {worker(w, dp): n for w, dp, n in req.loads}
        if any(n < 0 for n in loads.values()):
            raise BadRequest("loads must be >= 0")
        cands = None if req.candidates is None else [worker(w, dp) for w, dp in req.candidates]
        choice = self.router.choose(keys, loads, cands)
        return {
            "ok": True,
            "worker_id": choice.worker.worker_id,
            "dp_rank": choice.worker.dp_rank,
            "overlap": choice.overlap,
            "cost": choice.cost,
            "request_blocks": len(keys),
            "scores": _rows(choice.scores.scores),
        }

    def _keys(self, req: RouteRequest | MatchRequest) -> list[BlockKey]:
        given = [f for f in ("keys", "tokens", "vllm_hashes") if getattr(req, f) is not None]
        if len(given) != 1:
            raise BadRequest("give exactly one of keys, tokens, vllm_hashes")
        if req.keys is not None:
            return split_keys(req.keys)
        if req.tokens is not None:
            return self.router.keys_of_tokens(req.tokens)
        assert req.vllm_hashes is not None
        return vllm_keys(req.vllm_hashes)

    def stats(self) -> dict[str, Any]:
        return {
            "index": {str(w): n for w, n in sorted(self.router.index.workers().items())},
            "events": dict(self.subs.counts) | {"applied": self.router.events_applied},
            "hits": self.router.stats.snapshot(),
            "bad_requests": self.errors,
        }

    def close(self) -> None:
        self.subs.close()
        self.rep.close(0)
        self.ctx.term()


def _rows(d: dict[Worker, int]) -> list[list[int]]:
    return [[w.worker_id, w.dp_rank, n] for w, n in sorted(d.items())]
