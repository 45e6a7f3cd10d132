"""The sidecar's KV event publisher, end to end: a real sidecar with events on,
an engine saving through engine_shim.KVClient, and the router's subscriber."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from contract import events as wire
from router.keys import split_keys, worker
from router.router import Router
from router.subscriber import Source, Subscriptions
from tests.helpers import DEADLINE, wait_subscribed, wait_until
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


class Loopback:
    """A ZeroMQ context and sockets bound on loopback TCP, closed together
    (after the test closed whatever else it made on the context)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []

    def bind(self, kind: int, transport: str = "tcp") -> tuple[zmq.Socket, str]:
        """A socket of `kind` bound on a free port (or, with "inproc", on an
        inproc endpoint of this context), and its endpoint."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0" if transport == "tcp" else f"inproc://{uuid.uuid4().hex}")
        self._sockets.append(sock)
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(0)
        self.ctx.term()


@pytest.fixture
def loopback() -> Iterator[Loopback]:
    sockets = Loopback()
    yield sockets
    sockets.close()


def _save(endpoint: str, n_blocks: int, start: int = 0) -> list:
    client = connect(endpoint, make_kv(1))
    try:
        toks = tokens(n_blocks, start)
        assert client.save(toks, np.arange(n_blocks)).wait() == n_blocks * 16
        return split_keys(client._keys(toks).tobytes())
    finally:
        client.close()


def _save_published(ctx: zmq.Context, pub: str, endpoint: str, n_blocks: int) -> list:
    """Save `n_blocks` and return once their batch was published: seen by a
    SUB of our own. The sidecar publishes after the save's reply, so a SUB
    connecting right after `_save` may still receive it (a loaded machine)."""
    probe = ctx.socket(zmq.SUB)
    probe.setsockopt(zmq.LINGER, 0)
    probe.setsockopt(zmq.SUBSCRIBE, b"")
    probe.connect(pub)
    try:

        def next_batch() -> wire.EventBatch:
            assert probe.poll(int(DEADLINE * 1000)), "nothing published"
            return wire.decode_batch(probe.recv_multipart()[1])

        next_batch()  # a heartbeat or a batch: the probe is connected
        keys = _save(endpoint, n_blocks)
        while not next_batch().events:
            pass
        return keys
    finally:
        probe.close(0)


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
        wait_until(lambda: router.index.workers().get(WORKER) == 4, subs)
        assert router.find_matches(keys).scores == {WORKER: 4}
        assert router.choose(keys).worker == WORKER
        assert subs.counts["gaps"] == 0
    finally:
        subs.close()
        ctx.term()


@pytest.mark.parametrize("with_resync", [True, False])
def test_a_gap_resyncs_or_clears_without_a_resync_endpoint(
    sidecar: Sidecar, with_resync: bool
) -> None:
    pub, resync = sidecar.events  # type: ignore[attr-defined]
    ctx = zmq.Context()
    first = _save_published(ctx, pub, sidecar.endpoint, 3)  # before the router subscribed
    router = Router("radix" if with_resync else "flat")
    subs = Subscriptions(ctx, router, [Source(pub, resync if with_resync else None)])
    try:
        # Once a heartbeat (one a second) came, the SUB is connected: the next
        # batch arrives. That first message is the gap (the router joins late).
        wait_until(lambda: subs.counts["heartbeats"] >= 1, subs)
        assert subs.counts["gaps"] == 1
        second = _save(sidecar.endpoint, 2, start=10_000)
        expected = 5 if with_resync else 2  # without a dump the first save is forgotten
        wait_until(lambda: router.index.workers().get(WORKER) == expected, subs)
        assert subs.counts["gaps"] == 1 and subs.counts["resyncs"] == int(with_resync)
        assert router.find_matches(first).scores == ({WORKER: 3} if with_resync else {})
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


def test_event_config_is_checked() -> None:
    from sidecar.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="events_endpoint is not"):
        load_config(overrides={"events_resync_endpoint": "ipc:///tmp/x"})
    with pytest.raises(ConfigError, match="events_endpoint"):
        load_config(overrides={"events_endpoint": "udp://x"})
    with pytest.raises(ConfigError, match="events_worker_id"):
        load_config(overrides={"events_worker_id": -1})
    with pytest.raises(ConfigError, match="events_worker_id"):
        load_config(overrides={"events_worker_id": 2**63})  # not a msgpack int64
    same = {"events_endpoint": "ipc:///tmp/x", "events_resync_endpoint": "ipc:///tmp/x"}
    with pytest.raises(ConfigError, match="must all differ"):
        load_config(overrides=same)
    with pytest.raises(ConfigError, match="must all differ"):
        load_config(
            overrides={"endpoint": "tcp://127.0.0.1:7", "events_endpoint": "tcp://127.0.0.1:7"}
        )
    assert load_config().events_endpoint is None  # off by default


def test_a_malformed_dump_is_a_failed_resync_not_a_crash(loopback: Loopback) -> None:
    resync, resync_endpoint = loopback.bind(zmq.ROUTER)
    _, pub_endpoint = loopback.bind(zmq.PUB)
    bad = wire.DumpReply("e", 0, 3, 0, [wire.StoredMsg(b"x" * 15, None)])  # not 16-byte keys

    def answer_one() -> None:
        frames = resync.recv_multipart()
        resync.send_multipart([*frames[:-1], wire.encode(bad)])

    answerer = threading.Thread(target=answer_one)
    answerer.start()
    router = Router("radix")
    subs = Subscriptions(loopback.ctx, router, [Source(pub_endpoint, resync_endpoint)])
    try:
        subs.resync_all()
        assert subs.counts["resync_failures"] == 1 and subs.counts["resyncs"] == 0
        assert router.index.workers() == {}
    finally:
        answerer.join(5)
        subs.close()


def test_a_dead_resync_endpoint_is_not_retried_on_every_batch(loopback: Loopback) -> None:
    """Without an answer to resyncs, stores continuing blocks lost in the gap
    are skipped one by one (as without a resync endpoint), instead of each
    batch clearing the worker and blocking the router for another timeout."""
    _, silent = loopback.bind(zmq.ROUTER)  # takes resync requests, never answers
    pub, pub_endpoint = loopback.bind(zmq.XPUB)
    router = Router("flat")
    subs = Subscriptions(loopback.ctx, router, [Source(pub_endpoint, silent)], resync_timeout=0.2)
    a, b, c, d = (bytes([i]) * 16 for i in range(1, 5))

    def send(seq: int, keys: bytes, parent: bytes | None) -> None:
        batch = wire.EventBatch("e", seq, 3, 0, [wire.StoredMsg(keys, parent)])
        pub.send_multipart([wire.TOPIC, wire.encode(batch)])

    try:
        wait_subscribed(pub)
        send(5, b, a)  # joins mid-stream: a was stored before the router subscribed
        send(6, c, None)
        send(7, d, b)  # continues a block the router skipped
        wait_until(lambda: subs.counts["batches"] == 3, subs)
        assert subs.counts["resync_failures"] == 1 and subs.counts["gaps"] == 1
        assert router.find_matches(split_keys(c)).scores == {WORKER: 1}
    finally:
        subs.close()


def test_batches_of_a_restarted_publishers_old_epoch_cost_one_resync(
    loopback: Loopback,
) -> None:
    """Batches still queued from before a sidecar restart: the first one's
    resync shows the new epoch; the rest are dropped, not each resynced."""
    resync, resync_endpoint = loopback.bind(zmq.ROUTER)
    pub, pub_endpoint = loopback.bind(zmq.XPUB)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    dump = wire.encode(wire.DumpReply("new", 2, 3, 0, [wire.StoredMsg(a, None)]))
    stop = threading.Event()

    def answer() -> None:  # the restarted sidecar: epoch "new", after its batch 2
        while not stop.is_set():
            if resync.poll(20):
                frames = resync.recv_multipart()
                resync.send_multipart([*frames[:-1], dump])

    answerer = threading.Thread(target=answer)
    answerer.start()
    router = Router("radix")
    subs = Subscriptions(loopback.ctx, router, [Source(pub_endpoint, resync_endpoint)])

    def send(epoch: str, seq: int, keys: bytes, parent: bytes | None) -> None:
        batch = wire.EventBatch(epoch, seq, 3, 0, [wire.StoredMsg(keys, parent)])
        pub.send_multipart([wire.TOPIC, wire.encode(batch)])

    try:
        wait_subscribed(pub)
        for seq in (5, 6, 7):
            send("old", seq, bytes([seq]) * 16, None)
        send("new", 3, b, a)
        wait_until(lambda: subs.counts["batches"] == 4, subs)
        assert subs.counts["resyncs"] == 1
        assert router.find_matches(split_keys(a + b)).scores == {WORKER: 2}
    finally:
        stop.set()
        answerer.join(5)
        subs.close()


def test_drain_handles_at_most_max_messages(loopback: Loopback) -> None:
    pub, pub_endpoint = loopback.bind(zmq.XPUB, "inproc")
    router = Router("flat")
    subs = Subscriptions(loopback.ctx, router, [Source(pub_endpoint)])
    (sock,) = subs.sockets
    try:
        wait_subscribed(pub)
        for seq in range(1, 6):
            batch = wire.EventBatch("e", seq, 3, 0, [wire.StoredMsg(bytes([seq]) * 16, None)])
            pub.send_multipart([wire.TOPIC, wire.encode(batch)])
        # inproc: a message is in the SUB's queue when its send returns.
        assert sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
        subs.drain(sock, max_messages=2)
        assert subs.counts["batches"] == 2
        wait_until(lambda: subs.counts["batches"] == 5, subs)
        assert router.index.workers() == {WORKER: 5}
    finally:
        subs.close()


def test_a_killed_sidecar_is_forgotten_an_idle_one_is_not(sidecar: Sidecar) -> None:
    """Heartbeats keep an idle sidecar's worker; kill -9 stops them, and
    after worker_timeout the router no longer routes to its blocks."""
    pub, resync = sidecar.events  # type: ignore[attr-defined]
    ctx = zmq.Context()
    router = Router("radix")
    subs = Subscriptions(ctx, router, [Source(pub, resync)], worker_timeout=1.5)
    try:
        subs.resync_all()
        keys = _save(sidecar.endpoint, 4)
        wait_until(lambda: router.index.workers().get(WORKER) == 4, subs, expire=True)
        idle_until = time.monotonic() + 3.5  # over twice the timeout with nothing saved
        wait_until(lambda: time.monotonic() > idle_until, subs, expire=True)
        assert router.find_matches(keys).scores == {WORKER: 4}
        assert subs.counts["heartbeats"] >= 2 and subs.counts["workers_expired"] == 0
        sidecar.kill()
        wait_until(lambda: WORKER not in router.index.workers(), subs, expire=True)
        assert subs.counts["workers_expired"] == 1
        assert router.find_matches(keys).scores == {}
        sidecar.start()  # for the fixture's clean stop
    finally:
        subs.close()
        ctx.term()


def test_a_restarted_idle_sidecar_is_resynced_by_its_heartbeat(sidecar: Sidecar) -> None:
    """A sidecar restarted with an empty cache that saves nothing: its first
    heartbeat carries a new epoch, and the resync empties its worker."""
    pub, resync = sidecar.events  # type: ignore[attr-defined]
    ctx = zmq.Context()
    router = Router("flat")
    subs = Subscriptions(ctx, router, [Source(pub, resync)], worker_timeout=0)
    try:
        subs.resync_all()
        _save(sidecar.endpoint, 3)
        wait_until(lambda: router.index.workers().get(WORKER) == 3, subs, expire=True)
        assert sidecar.stop() == 0
        sidecar.start()
        wait_until(lambda: router.index.workers().get(WORKER) == 0, subs, expire=True)
        assert subs.counts["resyncs"] == 2
    finally:
        subs.close()
        ctx.term()


def _batch(epoch: str, seq: int, worker_id: int, keys: bytes, parent: bytes | None = None):
    msgs = [wire.StoredMsg(keys, parent)] if keys else []
    return [wire.TOPIC, wire.encode(wire.EventBatch(epoch, seq, worker_id, 0, msgs))]


def test_a_worker_id_is_followed_from_one_source_only(loopback: Loopback) -> None:
    """Two sidecars left on the same events_worker_id are not merged: the
    second one's events are dropped and counted; a source that changes its
    worker id has its old worker forgotten."""
    one, one_endpoint = loopback.bind(zmq.XPUB)
    two, two_endpoint = loopback.bind(zmq.XPUB)
    router = Router("radix")
    subs = Subscriptions(loopback.ctx, router, [Source(one_endpoint), Source(two_endpoint)])
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    try:
        wait_subscribed(one)
        wait_subscribed(two)
        one.send_multipart(_batch("e1", 1, 3, a))
        wait_until(lambda: router.index.workers() == {WORKER: 1}, subs)
        two.send_multipart(_batch("e2", 1, 3, b))
        two.send_multipart(_batch("e2", 2, 3, c))
        wait_until(lambda: subs.counts["worker_conflicts"] == 2, subs)
        assert router.index.workers() == {WORKER: 1}
        assert router.find_matches(split_keys(b)).scores == {}
        one.send_multipart(_batch("e1", 2, 4, c))  # the first source is worker 4 now
        wait_until(lambda: worker(4) in router.index.workers(), subs)
        assert router.index.workers() == {worker(4): 1}
        assert router.find_matches(split_keys(a)).scores == {}
        two.send_multipart(_batch("e2", 3, 3, b))  # worker 3 is free: the second source takes it
        wait_until(lambda: WORKER in router.index.workers(), subs)
        assert router.find_matches(split_keys(b)).scores == {WORKER: 1}
    finally:
        subs.close()


def test_heartbeats_reveal_a_lost_batch(loopback: Loopback) -> None:
    """A heartbeat carries the seq of the last batch: one past what the router
    has applied means a batch was lost, and the worker is cleared (no dump)."""
    pub, pub_endpoint = loopback.bind(zmq.XPUB)
    router = Router("flat")
    subs = Subscriptions(loopback.ctx, router, [Source(pub_endpoint)])
    a, b = bytes([1]) * 16, bytes([2]) * 16
    try:
        wait_subscribed(pub)
        pub.send_multipart(_batch("e", 1, 3, a))
        pub.send_multipart(_batch("e", 1, 3, b""))  # a heartbeat after batch 1: in step
        wait_until(lambda: subs.counts["heartbeats"] == 1, subs)
        # The first batch is a gap (the router joins), the heartbeat is not.
        assert router.index.workers() == {WORKER: 1} and subs.counts["gaps"] == 1
        pub.send_multipart(_batch("e", 2, 3, b""))  # batch 2 never came
        wait_until(lambda: subs.counts["heartbeats"] == 2, subs)
        assert subs.counts["gaps"] == 2 and router.index.workers() == {WORKER: 0}
        pub.send_multipart(_batch("e", 3, 3, b))  # followed again from there
        wait_until(lambda: router.index.workers() == {WORKER: 1}, subs)
        assert subs.counts["gaps"] == 2
    finally:
        subs.close()


def test_a_rejected_dump_is_not_retried_on_every_batch(loopback: Loopback) -> None:
    resync, resync_endpoint = loopback.bind(zmq.ROUTER)
    pub, pub_endpoint = loopback.bind(zmq.XPUB)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    orphan = wire.StoredMsg(b, bytes([9]) * 16)  # its parent is in no run: the index refuses it
    dump = wire.encode(wire.DumpReply("e", 1, 3, 0, [wire.StoredMsg(a, None), orphan]))
    answered = []
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if resync.poll(20):
                frames = resync.recv_multipart()
                answered.append(1)  # before the reply: the router may act on it first
                resync.send_multipart([*frames[:-1], dump])

    answerer = threading.Thread(target=answer)
    answerer.start()
    router = Router("radix")
    subs = Subscriptions(loopback.ctx, router, [Source(pub_endpoint, resync_endpoint)])
    try:
        wait_subscribed(pub)
        for seq in range(5, 10):
            pub.send_multipart(_batch("e", seq, 3, bytes([seq]) * 16))
        wait_until(lambda: subs.counts["batches"] == 5, subs)
        assert len(answered) == 1 and subs.counts["resync_failures"] == 1
    finally:
        stop.set()
        answerer.join(5)
        subs.close()


def test_a_message_too_deeply_nested_is_dropped(loopback: Loopback) -> None:
    """msgspec raises RecursionError on deep nesting: a bad message, not the
    end of the router."""
    pub, pub_endpoint = loopback.bind(zmq.XPUB)
    router = Router("flat")
    subs = Subscriptions(loopback.ctx, router, [Source(pub_endpoint, None, 7)])
    good = [b"kv", (0).to_bytes(8, "big"), bytes.fromhex("92cb0000000000000000") + b"\x90"]
    try:
        wait_subscribed(pub)
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), b"\x91" * 10_000 + b"\xc0"])
        pub.send_multipart(good)
        wait_until(lambda: subs.counts["batches"] == 1, subs)
        assert subs.counts["bad_messages"] == 1
    finally:
        subs.close()


def test_one_dump_answers_a_crowd_of_resync_requests(sidecar: Sidecar) -> None:
    """Requests beyond `most` wait for the next loop iteration (the engines'
    requests are served in between); every one is answered."""
    _, resync = sidecar.events  # type: ignore[attr-defined]
    _save(sidecar.endpoint, 2)
    ctx = zmq.Context()
    reqs = []
    try:
        for _ in range(40):
            req = ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(resync)
            req.send(wire.DUMP_REQUEST)
            reqs.append(req)
        for req in reqs:
            assert req.poll(10_000)
            dump = wire.decode_reply(req.recv())
            assert isinstance(dump, wire.DumpReply) and len(dump.runs) == 1
    finally:
        for req in reqs:
            req.close(0)
        ctx.term()
