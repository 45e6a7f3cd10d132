"""The metrics port: Prometheus's `/metrics`, and `/healthz` and `/readyz`
for probes (a Kubernetes liveness and readiness probe, a load balancer).

prometheus-client's WSGI app serves `/metrics`; a small WSGI app in front
routes the probes and answers 404 for any other path. The server is
prometheus-client's thread-per-request WSGI server on one daemon thread;
everything it answers is read-only (the published stats snapshot, a flag).
It shares the process's file descriptors with the engines' socket, so a
connection is dropped once idle for `IDLE_SECONDS`, and past
`MAX_CONNECTIONS` at once new ones are closed unanswered: idle connections
by the thousand once used up the descriptors, and libzmq aborted the
sidecar at the next engine's connect.
"""

from __future__ import annotations

import importlib.metadata
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Info,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from sidecar.metrics.prometheus import StatsCollector

log = logging.getLogger("kvsidecar")

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def version() -> str:
    """The installed kvsidecar's version ("unknown" when run from a tree that
    is not installed)."""
    try:
        return importlib.metadata.version("kvsidecar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def metrics_registry(snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """The sidecar's figures, `kvsidecar_build_info`, and prometheus-client's
    process, platform and garbage-collector collectors."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(snapshot))
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    Info("kvsidecar_build", "the sidecar's version", registry=registry).info({"version": version()})
    return registry


def routes(metrics: WsgiApp, ready: Callable[[], bool]) -> WsgiApp:
    """`/metrics` to `metrics`; `/healthz` 200 while the process answers;
    `/readyz` 200 while `ready()`, else 503; anything else 404."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/healthz":
            status, body = "200 OK", b"ok\n"
        elif path == "/readyz":
            status, body = (
                ("200 OK", b"ready\n") if ready() else ("503 Service Unavailable", b"not ready\n")
            )
        else:
            status, body = "404 Not Found", b"not found: try /metrics, /healthz or /readyz\n"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return app


MAX_CONNECTIONS = 64
"""Connections served at once; more are closed at once, unanswered."""

IDLE_SECONDS = 10.0
"""A connection that sends nothing for this long is closed."""


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        """Probes come every few seconds: no line per request."""


def serve_metrics(
    host: str, port: int, snapshot: Callable[[], dict[str, Any]], ready: Callable[[], bool]
) -> WSGIServer:
    """Serve on host:port from a daemon thread; returns the server (call
    `.shutdown()` then `.server_close()` to stop it). OSError if it cannot bind."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        request_queue_size = 128  # the listen backlog: 5 dropped connections in a burst

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)  # starts its thread
            except BaseException:
                self.slots.release()
                raise

        def handle_error(self, request: Any, client_address: Any) -> None:
            """A client that went quiet or away: not worth a traceback on
            stderr (any local client could fill the journal with them)."""
            log.debug("metrics connection from %s ended with an error", client_address)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

    app = routes(make_wsgi_app(metrics_registry(snapshot)), ready)
    server = make_server(host, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="kvsidecar-metrics", daemon=True).start()
    return server
