"""Engines for the tests of `kvsidecar router proxy`, and their tokenizer.

`make_tokenizer(dir)` saves a small byte-level BPE tokenizer with a chat
template, trained here on fixed text (nothing is downloaded): the proxy and
the engines load it as a model's tokenizer.

`python -m tests.router_engines --tokenizer DIR --name NAME [--events]` is a
stand-in for a vLLM server: a real aiohttp server on a free loopback port
that answers /v1/completions and /v1/chat/completions (JSON, or a
server-sent event stream with `"stream": true`), /v1/models, and publishes
vLLM's KV events (BlockStored with token ids, vLLM's array encoding, three
frames) on an XPUB socket for the full blocks of every prompt it serves.
Replies name the engine, so a test sees where a request went. Hooks for the
tests: GET /subscribers (subscriptions its XPUB has seen, batches it
published), POST /release
(ends the streams waiting for it then: a request with `"hold": true` sends
its first chunk, then waits for the next /release).

`StallingEngine(head)` is an engine that hangs: a plain TCP listener in a
thread of the test that accepts, reads a request's head, sends `head` (b"":
nothing) and then nothing more, holding the connection open until closed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import zmq

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = (
    "You are the assistant of a bakery with three shops. Opening hours: Monday to "
    "Friday 7:00-19:00. Cakes must be ordered two days ahead. Delivery within 5 km. "
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
) * 8


def make_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer (vocabulary < 1000, tiny_llama's) saved in
    `directory` as a transformers tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )
    fast.add_bos_token = True
    fast.save_pretrained(str(directory))
    return directory


ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 120.0


class Proc:
    """A child process whose first stdout line says where it listens; its
    stdout and stderr are drained by threads (kept for failure messages).
    `stop` closes its stdin (the stand-ins exit), then SIGTERMs, then kills."""

    def __init__(self, *argv: str, first_line_has: str = "") -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put)),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err.append)),
        ]
        for t in self._threads:
            t.start()
        try:
            self.first = self.lines.get(timeout=DEADLINE)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"{argv} printed nothing: {''.join(self.err)[-2000:]}") from None
        assert first_line_has in self.first, self.first + "".join(self.err)[-2000:]

    @staticmethod
    def _pump(stream: Any, sink: Any) -> None:
        for line in stream:
            sink(line)

    def stop(self, sig_first: bool = False) -> int:
        if self.proc.poll() is None:
            if sig_first:
                self.proc.terminate()
            else:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=DEADLINE / 4)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=DEADLINE / 4)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for t in self._threads:
            t.join()
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        return self.proc.returncode


def start_engine(tokenizer: Path, name: str, events: bool = True) -> tuple[Proc, dict[str, str]]:
    """A stand-in engine: the process and {"url", "events"}."""
    argv = ["-m", "tests.router_engines", "--tokenizer", str(tokenizer), "--name", name]
    proc = Proc(*argv, *(["--events"] if events else []), first_line_has='"url"')
    return proc, json.loads(proc.first)


def start_proxy(*args: str) -> tuple[Proc, str]:
    """`kvsidecar router proxy --port 0 ARGS`: the process and its base URL."""
    proc = Proc(
        "-m", "kvsidecar", "router", "proxy", "--port", "0", *args, first_line_has="listening on"
    )
    return proc, proc.first.split("listening on ")[1].split()[0]


def metric(url: str, name: str, labels: str = "", absent: float | None = None) -> float:
    """A sample's value in the proxy at `url`'s /metrics (`absent` if given
    and it is not exported)."""
    text = http(url + "/metrics")[1]
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    if m is None and absent is not None:
        return absent
    assert m, f"{name}{labels} not in\n{text}"
    return float(m.group(1))


def http(
    url: str,
    body: Any = None,
    method: str | None = None,
    raw: bytes | None = None,
    timeout: float = DEADLINE,
) -> tuple[int, Any]:
    """(status, decoded JSON body, or the text if it is not JSON)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class StallingEngine:
    """A TCP server that accepts, answers each request with `head` alone and
    then stays silent, the connection open, until `close`."""

    def __init__(self, head: bytes = b"") -> None:
        self.head = head
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="stalling-engine")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            self._conns.append(conn)
            conn.settimeout(DEADLINE)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                conn.sendall(self.head)
            except OSError:
                continue  # the proxy gave up on it: so be it

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> StallingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StandIn:
    """The stand-in engine's state: its name, KV publisher and held streams."""

    def __init__(self, name: str, tokenizer: str, block_size: int, events: bool) -> None:
        from router.prompts import PromptTokenizer

        self.name = name
        self.prompts = PromptTokenizer(tokenizer)
        self.block_size = block_size
        self.seed = hashlib.blake2b(name.encode()).digest()  # vLLM's hashes are per engine
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB) if events else None
        self.endpoint = ""
        if self.pub is not None:
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind("tcp://127.0.0.1:0")
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.subscribers = 0
        self.seq = 0
        self.held: dict[bytes, None] = {}
        self.release = asyncio.Event()
        self.served = 0

    def publish(self, tokens: list[int]) -> None:
        """BlockStored for the prompt's full blocks not held yet."""
        if self.pub is None:
            return
        bs, parent, events = self.block_size, None, []
        for i in range(len(tokens) // bs):
            block = tokens[i * bs : (i + 1) * bs]
            h = hashlib.sha256(self.seed + (parent or b"") + json.dumps(block).encode()).digest()
            if h not in self.held:
                self.held[h] = None
                events.append(["BlockStored", [h], parent, block, bs, None, "GPU"])
            parent = h
        if events:
            payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
            self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
            self.seq += 1

    def count_subscribers(self) -> int:
        while self.pub is not None and self.pub.poll(0):
            if self.pub.recv()[:1] == b"\x01":
                self.subscribers += 1
        return self.subscribers


async def _generate(state: StandIn, request: Any, chat: bool) -> Any:
    from aiohttp import web

    body = await request.json()
    tokens = state.prompts.chat(body) if chat else state.prompts.completion(body)
    state.publish(tokens)
    state.served += 1
    reply = {"engine": state.name, "prompt_tokens": len(tokens), "served": state.served}
    if not body.get("stream"):
        return web.json_response({"object": "text_completion", "choices": [{"text": "ok"}]} | reply)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for i in range(3):
        await out.write(f"data: {json.dumps(reply | {'chunk': i})}\n\n".encode())
        if i == 0 and body.get("hold"):
            await state.release.wait()
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def _main(args: argparse.Namespace) -> None:
    from aiohttp import web

    state = StandIn(args.name, args.tokenizer, args.block_size, args.events)

    async def completions(request: web.Request) -> Any:
        return await _generate(state, request, chat=False)

    async def chat(request: web.Request) -> Any:
        return await _generate(state, request, chat=True)

    async def models(request: web.Request) -> Any:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "engine": args.name}]})

    async def subscribers(request: web.Request) -> Any:
        count = state.count_subscribers()
        return web.json_response({"subscribers": count, "published": state.seq})

    async def release(request: web.Request) -> Any:
        # Ends the streams waiting now, and only those: a later "hold" waits
        # for a later /release (a set Event left every hold after the first
        # release unheld, so the test after one that released ran unheld).
        state.release.set()
        state.release = asyncio.Event()
        return web.json_response({"released": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/subscribers", subscribers)
    app.router.add_post("/release", release)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"url": f"http://127.0.0.1:{port}", "events": state.endpoint}), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed
    finally:
        await runner.cleanup()
        if state.pub is not None:
            state.pub.close(0)
        state.ctx.term()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--events", action="store_true")
    asyncio.run(_main(parser.parse_args()))
