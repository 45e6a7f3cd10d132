"""The sidecar's KV event publisher, end to end: a real sidecar with events on,
an engine saving through engine_shim.KVClient, and the router's subscriber."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from router import wire
from router.keys import split_keys, worker
from router.router import Router
from router.subscriber import Source, Subscriptions
from tests.sidecar_proc import Sidecar, connect, make_kv, tokens

WORKER = worker(3)


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    s = Sidecar()
    pub, resync = f"ipc://{s.runtime_dir}/ev.pub", f"ipc://{s.runtime_dir}/ev.resync"
    s.args += ["--set", f"events_endpoint={pub}", "--set", f"events_resync_endpoint={resync}"]
    s.args += ["--set", "events_worker_id=3"]
    s.start()
    s.events = (pub, resync)  # type: ignore[attr-defined]
    yield s
    try:
        assert s.stop() == 0
    finally:
        s.cleanup()


def _wait(cond: Callable[[], bool], subs: Subscriptions, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, dict(subs.counts)
        for sock in subs.sockets:
            if sock.poll(20):
                subs.drain(sock)


def _save(endpoint: str, n_blocks: int, start: int = 0) -> list:
    client = connect(endpoint, make_kv(1))
    try:
        toks = tokens(n_blocks, start)
        assert client.save(toks, np.arange(n_blocks)).wait() == n_blocks * 16
        return split_keys(client._keys(toks).tobytes())
    finally:
        client.close()


@pytest.mark.parametrize("index", ["radix", "flat"])
def test_router_sees_blocks_an_engine_saved(sidecar: Sidecar, index: str) -> None:
    pub, resync = sidecar.events  # type: ignore[attr-defined]
    ctx = zmq.Context()
    router = Router(index)
    subs = Subscriptions(ctx, router, [Source(pub, resync)])
    try:
        subs.resync_all()  # joins with an empty dump: epoch and seq known
        assert router.index.workers() == {WORKER: 0} and subs.counts["resyncs"] == 1
        keys = _save(sidecar.endpoint, 4)
        _wait(lambda: router.index.workers().get(WORKER) == 4, subs)
        assert router.find_matches(keys).scores == {WORKER: 4}
        assert router.choose(keys).worker == WORKER
        assert subs.counts["gaps"] == 0
    finally:
        subs.close()
        ctx.term()


def test_a_gap_triggers_a_resync(sidecar: Sidecar) -> None:
    pub, resync = sidecar.events  # type: ignore[attr-defined]
    first = _save(sidecar.endpoint, 3)  # published before the router subscribed
    ctx = zmq.Context()
    router = Router("radix")
    subs = Subscriptions(ctx, router, [Source(pub, resync)])
    try:
        time.sleep(0.3)  # let the SUB connect, so the next batch arrives
        second = _save(sidecar.endpoint, 2, start=10_000)
        _wait(lambda: router.index.workers().get(WORKER) == 5, subs)
        assert subs.counts["gaps"] == 1 and subs.counts["resyncs"] == 1
        assert router.find_matches(first).scores == {WORKER: 3}
        assert router.find_matches(second).scores == {WORKER: 2}
    finally:
        subs.close()
        ctx.term()


def test_without_a_resync_endpoint_a_gap_clears_and_carries_on(sidecar: Sidecar) -> None:
    pub, _ = sidecar.events  # type: ignore[attr-defined]
    _save(sidecar.endpoint, 3)
    ctx = zmq.Context()
    router = Router("flat")
    subs = Subscriptions(ctx, router, [Source(pub)])
    try:
        time.sleep(0.3)
        second = _save(sidecar.endpoint, 2, start=10_000)
        _wait(lambda: router.index.workers().get(WORKER) == 2, subs)
        assert subs.counts["gaps"] == 1 and subs.counts["resyncs"] == 0
        assert router.find_matches(second).scores == {WORKER: 2}
    finally:
        subs.close()
        ctx.term()


def test_resync_endpoint_answers_a_bad_request_with_an_error(sidecar: Sidecar) -> None:
    _, resync = sidecar.events  # type: ignore[attr-defined]
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(resync)
        req.send(b"give me everything")
        assert req.poll(5000)
        reply = wire.decode_reply(req.recv())
        assert isinstance(reply, wire.ErrorReply) and "dump" in reply.message
        req.send(wire.DUMP_REQUEST)
        assert req.poll(5000)
        dump = wire.decode_reply(req.recv())
        assert isinstance(dump, wire.DumpReply) and dump.worker_id == 3 and dump.runs == []
    finally:
        req.close(0)
        ctx.term()
