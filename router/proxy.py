"""`kvsidecar router proxy`: an OpenAI-compatible HTTP front for N engines.

    POST /v1/completions, /v1/chat/completions   routed, forwarded, streamed back
    GET  /v1/models                              forwarded to an engine that is up
    GET  /health                                 200 while an engine is up, else 503
    GET  /metrics                                Prometheus text

A generation request is tokenized (router/prompts.py), routed
(router/proxy_routing.py) and forwarded byte for byte; the engine's reply
is copied back chunk by chunk as it arrives, so a `"stream": true` reply
stays a live server-sent event stream. An engine that cannot be reached
(connection refused, reset, or closed before it answered) is marked down
and the request goes to the next choice; an engine's own error reply (4xx,
5xx) is passed back as it is. An engine silent for longer than the read
timeout is not: the request reached it and it may be generating, so it is
not sent again elsewhere. Silent before its headers, the client gets a 504;
silent mid-reply, the client's connection is closed (its status is sent).
Built on aiohttp (docs/router.md says why).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.choice import NoWorkers
from router.prompts import PromptError, PromptTokenizer
from router.proxy_routing import ProxyRouting, Routed
from router.upstreams import Upstream

log = logging.getLogger("kvsidecar.router")

MAX_BODY_BYTES = 64 << 20
"""A larger request body is refused (413) unread."""
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
}  # fmt: skip


class Proxy:
    def __init__(
        self,
        routing: ProxyRouting,
        prompts: PromptTokenizer | None,
        connect_timeout: float = 2.0,
        read_timeout: float | None = 600.0,
    ) -> None:
        """`prompts`: None routes by load alone (no tokenizer given).
        `read_timeout`: how long an engine may send nothing, before its reply's
        headers (counted from the end of the request) and between two chunks of
        its body; None: for ever."""
        self.routing = routing
        self.prompts = prompts
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.counts: dict[str, int] = {}
        self.served: dict[int, int] = dict.fromkeys(routing.upstreams, 0)
        self.timeouts: dict[int, int] = dict.fromkeys(routing.upstreams, 0)
        self._session: aiohttp.ClientSession | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
        )
        # auto_decompress off: bytes go back as the engine encoded them.
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tokenize = None if self.prompts is None else self.prompts.completion
        return await self._generate(request, "/v1/completions", tokenize)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        tokenize = None if self.prompts is None else self.prompts.chat
        return await self._generate(request, "/v1/chat/completions", tokenize)

    async def _generate(
        self,
        request: web.Request,
        path: str,
        tokenize: Callable[[dict[str, Any]], list[int]] | None,
    ) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._count("bad_requests")
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            self._count("bad_requests")
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(payload, dict):
            self._count("bad_requests")
            return _error(400, "the body must be a JSON object")
        tokens: list[int] = []
        if tokenize is not None:
            try:
                tokens = tokenize(payload)
            except PromptError:
                self._count("untokenized_requests")
        tried: set[int] = set()
        while True:
            try:
                routed = self.routing.pick(tokens, tried)
            except NoWorkers:
                self._count("unserved_requests")
                return _error(503, "no engine is up")
            tried.add(routed.upstream.spec.worker_id)
            out = await self._forward(request, routed, "POST", path, body)
            if out is not None:
                return out
            self._count("retries")

    async def _forward(
        self, request: web.Request, routed: Routed, method: str, path: str, body: bytes
    ) -> web.StreamResponse | None:
        """The engine's reply, streamed back; None if the engine could not be
        reached (it is then marked down and nothing was sent back). A 504 if
        it sent no headers within the read timeout: neither marked down (slow
        is not unreachable) nor retried (it may be generating)."""
        assert self._session is not None
        up = routed.upstream
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        self.routing.begin(routed)
        try:
            try:
                resp = await self._session.request(
                    method, up.spec.url + path, data=body or None, headers=headers
                )
            except aiohttp.SocketTimeoutError:  # before ClientConnectionError, its base
                self._timed_out(up, "timeouts", "before its headers: answered 504")
                return _error(504, f"the engine sent no reply within {self.read_timeout} s")
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                self.routing.mark_down(up)
                return None
            try:
                return await self._relay(request, resp, up)
            finally:
                resp.release()
        finally:
            self.routing.end(routed)

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, up: Upstream
    ) -> web.StreamResponse:
        """Copy the engine's reply back as it comes."""
        out = web.StreamResponse(status=resp.status, reason=resp.reason)
        for k, v in resp.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                out.headers.add(k, v)
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except aiohttp.SocketTimeoutError:
            self._timed_out(up, "truncated_replies", "mid-reply: the client's connection is cut")
            # The status is sent: an end before the body's is all that can tell
            # the client. (aiohttp's own end of the reply then finds the
            # connection closed and leaves it.)
            if request.transport is not None:
                request.transport.close()
            return out
        await out.write_eof()
        self.served[up.spec.worker_id] += 1
        return out

    def _timed_out(self, up: Upstream, outcome: str, what: str) -> None:
        self._count(outcome)
        self.timeouts[up.spec.worker_id] += 1
        log.warning(
            "engine %s (%s) silent for %s s %s",
            up.spec.worker_id,
            up.spec.url,
            self.read_timeout,
            what,
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        tried: set[int] = set()
        while True:
            pool = [u for wid, u in self.routing.upstreams.items() if wid not in tried and u.up()]
            if not pool:
                return _error(503, "no engine is up")
            up = min(pool, key=lambda u: (u.in_flight, u.spec.worker_id))
            tried.add(up.spec.worker_id)
            out = await self._forward(request, Routed(up, 0, 0), "GET", "/v1/models", b"")
            if out is not None:
                return out

    async def health(self, request: web.Request) -> web.Response:
        blocks = self.routing.blocks()
        workers = [_describe(u, blocks[wid]) for wid, u in self.routing.upstreams.items()]
        up = any(w["up"] for w in workers)
        return web.json_response(
            {"status": "ok" if up else "no engine is up", "workers": workers},
            status=200 if up else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")


def _describe(u: Upstream, blocks: int) -> dict[str, Any]:
    return {
        "id": u.spec.worker_id,
        "url": u.spec.url,
        "events": u.spec.kind,
        "up": u.up(),
        "in_flight": u.in_flight,
        "blocks": blocks,
        "failures": u.failures,
    }


def _error(status: int, message: str) -> web.Response:
    """An error in the OpenAI API's shape."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


class _Collector:
    """The proxy's figures, read at each scrape."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def collect(self) -> Any:
        p = self.proxy
        ups = p.routing.upstreams
        per_worker = [
            ("requests", "Requests an engine answered", p.served, True),
            ("in_flight", "Requests sent and not finished", _of(ups, "in_flight"), False),
            ("engine_up", "1 if the engine is tried, 0 if marked down", _up(ups), False),
            ("engine_failures", "Connections the engine refused", _of(ups, "failures"), True),
            ("engine_timeouts", "Replies the engine was silent on too long", p.timeouts, True),
            ("index_blocks", "Blocks the index holds for it", p.routing.blocks(), False),
        ]
        for name, doc, values, counter in per_worker:
            family_of = CounterMetricFamily if counter else GaugeMetricFamily
            family = family_of(f"kvsidecar_proxy_{name}", doc, labels=["worker"])
            for wid, value in values.items():
                family.add_metric([str(wid)], value)
            yield family
        totals = p.routing.router.stats.total
        yield CounterMetricFamily(
            "kvsidecar_proxy_prompt_blocks", "Prompt blocks routed", value=totals.requested_blocks
        )
        yield CounterMetricFamily(
            "kvsidecar_proxy_overlap_blocks",
            "Of them, blocks the chosen engine already held",
            value=sum(totals.hit_blocks.values()),
        )
        events = CounterMetricFamily("kvsidecar_proxy_events", "KV event figures", labels=["kind"])
        for kind, n in sorted(p.routing.event_counts().items()):
            events.add_metric([kind], n)
        yield events
        misc = CounterMetricFamily("kvsidecar_proxy_outcomes", "Request outcomes", labels=["kind"])
        for kind, n in sorted((p.counts | dict(p.routing.counts)).items()):
            misc.add_metric([kind], n)
        yield misc


def _of(ups: dict[int, Upstream], attr: str) -> dict[int, int]:
    return {wid: getattr(u, attr) for wid, u in ups.items()}


def _up(ups: dict[int, Upstream]) -> dict[int, int]:
    return {wid: int(u.up()) for wid, u in ups.items()}
