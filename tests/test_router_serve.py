"""`kvsidecar router serve` as a process: routes by keys and tokens, answers
malformed requests with an error, follows a real sidecar's KV events."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from tests.sidecar_proc import DEADLINE, ROOT, Sidecar, connect, make_kv, read_line, tokens


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    s = Sidecar()
    s.args += ["--set", f"events_endpoint=ipc://{s.runtime_dir}/ev.pub"]
    s.args += ["--set", f"events_resync_endpoint=ipc://{s.runtime_dir}/ev.resync"]
    s.args += ["--set", "events_worker_id=5"]
    s.start()
    yield s
    try:
        assert s.stop() == 0
    finally:
        s.cleanup()


class RouterProc:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar", "router", "serve", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = read_line(self.proc.stdout, time.monotonic() + DEADLINE) or ""
        if "router serving on" not in line:
            self.proc.kill()
            raise AssertionError(line + self.proc.communicate()[1])
        self.endpoint = line.split()[3]
        self.ctx = zmq.Context()
        self.sock = self._socket()

    def _socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def ask(self, request: Any, raw: bool = False) -> dict[str, Any]:
        self.sock.send(request if raw else msgspec.msgpack.encode(request))
        assert self.sock.poll(10_000), "router did not answer"
        return msgspec.msgpack.decode(self.sock.recv())

    def stop(self) -> int:
        self.sock.close(0)
        self.ctx.term()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            assert pipe is not None
            pipe.close()
        return code


@pytest.mark.parametrize("secret", [b"", b"deployment secret"])
def test_routes_to_the_sidecar_holding_the_prefix(
    sidecar: Sidecar, tmp_path: Path, secret: bytes
) -> None:
    client = connect(sidecar.endpoint, make_kv(2), secret=secret)
    toks = tokens(6)
    try:
        assert client.save(toks, np.arange(6)).wait() == 96
        keys = client._keys(toks).tobytes()
        ns = tmp_path / "ns.json"
        ns.write_text(json.dumps(dataclasses.asdict(client._hasher.namespace)))  # type: ignore[union-attr]
    finally:
        client.close()
    pub = f"ipc://{sidecar.runtime_dir}/ev.pub,ipc://{sidecar.runtime_dir}/ev.resync"
    args = ["--bind", "tcp://127.0.0.1:0", "--sidecar", pub, "--namespace", str(ns)]
    if secret:
        (tmp_path / "secret").write_bytes(secret)
        args += ["--secret-file", str(tmp_path / "secret")]
    router = RouterProc(*args)
    try:
        deadline = time.monotonic() + DEADLINE
        while router.ask({"op": "stats"})["index"].get("5/0") != 6:  # the start-up resync
            assert time.monotonic() < deadline
            time.sleep(0.05)
        reply = router.ask({"op": "route", "keys": keys + bytes(16)})
        assert reply["ok"] and (reply["worker_id"], reply["dp_rank"]) == (5, 0)
        assert reply["overlap"] == 6 and reply["request_blocks"] == 7 and reply["cost"] == 1
        by_tokens = router.ask({"op": "route", "tokens": toks.tolist()})
        assert by_tokens["overlap"] == 6 and by_tokens["cost"] == 0
        match = router.ask({"op": "match", "keys": keys[:32]})
        assert match == {"ok": True, "scores": [[5, 0, 2]], "tree_sizes": [[5, 0, 6]]}
        loaded = router.ask({"op": "route", "keys": keys, "loads": [[5, 0, 3]]})
        assert loaded["cost"] == 3
        stats = router.ask({"op": "stats"})
        assert stats["hits"]["all"]["requests"] == 3 and stats["events"]["resyncs"] >= 1
    finally:
        assert router.stop() == 0


BAD = [
    (b"\xc1not msgpack", True, "malformed"),
    ({"op": "fly"}, False, "Invalid value 'fly'"),
    ({"keys": bytes(16)}, False, "op"),
    ({"op": "route"}, False, "exactly one of"),
    ({"op": "route", "keys": bytes(16), "tokens": [1]}, False, "exactly one of"),
    ({"op": "route", "keys": bytes(15)}, False, "multiple of 16"),
    ({"op": "route", "tokens": [1, 2]}, False, "no token hasher"),
    ({"op": "route", "keys": bytes(16), "extra": 1}, False, "unknown field"),
    ({"op": "route", "keys": bytes(16), "loads": [[0, 0, -1]]}, False, ">= 0"),
    ({"op": "route", "vllm_hashes": [1.5]}, False, "Expected"),
    ({"op": "route", "keys": bytes(16)}, False, "no worker is known"),
    ({"op": "route", "keys": bytes(16), "candidates": [[11, 0]]}, False, "not known"),
    ({"op": "route", "keys": bytes(16), "candidates": []}, False, "candidates is empty"),
]


def test_malformed_requests_get_an_error_reply_and_change_nothing() -> None:
    router = RouterProc("--bind", "tcp://127.0.0.1:0", "--index", "flat")
    try:
        for request, raw, message in BAD:
            reply = router.ask(request, raw=raw)
            assert reply["ok"] is False and message in reply["error"], (request, reply)
        stats = router.ask({"op": "stats"})
        assert stats["bad_requests"] == len(BAD) and stats["index"] == {}
        assert stats["hits"]["all"]["requests"] == 0
    finally:
        assert router.stop() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vllm", "tcp://x:1=abc"], "PUB=WORKER_ID"),
        (["--vllm", f"tcp://127.0.0.1:1={2**64}"], "PUB=WORKER_ID"),  # replies could not encode it
        (["--sidecar", "tcp://127.0.0.1:1,foo"], "not a ZMQ endpoint: 'foo'"),
        (["--sidecar", "tcp://bad"], "cannot bind or connect"),
        (["--sidecar", "tcp://127.0.0.1:1,tcp://bad"], "cannot bind or connect"),
        (["--bind", "tcp://bad"], "cannot bind or connect"),
        (["--sidecar", "tcp://127.0.0.1:1", "--sidecar", "tcp://127.0.0.1:1"], "given twice"),
        (["--secret-file", "/dev/null"], "give --namespace too"),
        (["--worker-timeout", "-1"], "--worker-timeout must be >= 0"),
    ],
)
def test_bad_command_line_exits_2(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "router", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def ask():
    """Send frames to an in-process router, serve them, return its reply."""
    from router.router import Router
    from router.serve import RouterServer

    server = RouterServer(Router("flat"), "tcp://127.0.0.1:0", [])
    req = server.ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.endpoint)

    def call(*frames: bytes) -> dict:
        req.send_multipart(list(frames))
        server.poll_once(5000)
        assert req.poll(5000)
        return msgspec.msgpack.decode(req.recv())

    try:
        yield call
    finally:
        req.close(0)
        server.close()


def test_a_multipart_request_gets_an_error_reply(ask) -> None:
    reply = ask(msgspec.msgpack.encode({"op": "stats"}), b"extra")
    assert reply["ok"] is False and "1 frame" in reply["error"]
    # The socket still serves.
    assert ask(msgspec.msgpack.encode({"op": "stats"}))["bad_requests"] == 1


def test_a_request_over_the_size_limit_gets_an_error_reply(ask) -> None:
    from router.serve import MAX_REQUEST_BYTES

    keys = b"k" * (MAX_REQUEST_BYTES + 16)  # whole 16-byte keys, too many
    reply = ask(msgspec.msgpack.encode({"op": "route", "keys": keys}))
    assert reply["ok"] is False and "over 16777216 bytes" in reply["error"]
    assert ask(msgspec.msgpack.encode({"op": "stats"}))["bad_requests"] == 1
