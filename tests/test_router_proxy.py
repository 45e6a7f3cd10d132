"""`kvsidecar router proxy` in front of stand-in engines: real processes,
real HTTP servers on loopback sockets, real vLLM-encoded KV events over ZMQ
(tests/router_engines.py)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from http.client import IncompleteRead
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

from router.upstreams import parse_worker, parse_workers
from tests.router_engines import (
    DEADLINE,
    Proc,
    StallingEngine,
    http,
    make_tokenizer,
    metric,
    start_engine,
    start_proxy,
)
from tests.sidecar_proc import run_cli, wait_for

PROMPT = (
    "You are the assistant of a bakery with three shops. Opening hours: Monday to Friday "
    "7:00-19:00. Cakes must be ordered two days ahead. Delivery within 5 km. "
)
OTHER = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. " * 2
SILENT = 30.0
"""Where the read timeout is 0.5 s: an answer within this long shows it worked."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


class Fleet:
    def __init__(self, tokenizer: Path, n: int, events: bool = True) -> None:
        self.engines: list[tuple[Proc, dict[str, str]]] = []
        self.proxy: Proc | None = None
        try:
            for i in range(n):
                self.engines.append(start_engine(tokenizer, f"e{i}", events))
            specs = [
                info["url"] + (f",vllm={info['events']}" if events else "")
                for _, info in self.engines
            ]
            args = ["--tokenizer", str(tokenizer), "--down-seconds", "600"]
            self.proxy, self.url = start_proxy(*args, *(a for s in specs for a in ("--worker", s)))
            if events:
                for _, info in self.engines:
                    wait_for(lambda info=info: http(info["url"] + "/subscribers")[1]["subscribers"])
        except BaseException:
            self.close()
            raise

    def engine_url(self, name: str) -> str:
        return self.engines[int(name[1:])][1]["url"]

    def settle(self) -> None:
        """Wait until the proxy has applied every batch the engines published."""

        def published() -> int:
            return sum(http(i["url"] + "/subscribers")[1]["published"] for _, i in self.engines)

        kind = '{kind="batches"}'
        wait_for(lambda: self.metric("kvsidecar_proxy_events_total", kind, 0) == published())

    def health(self) -> dict:
        return http(self.url + "/health")[1]

    def blocks(self, name: str) -> int:
        return self.health()["workers"][int(name[1:])]["blocks"]

    def metric(self, name: str, labels: str = "", absent: float | None = None) -> float:
        """A sample's value (`absent` if given and it is not exported)."""
        return metric(self.url, name, labels, absent)

    def routing_figures(self) -> str:
        """The proxy's per-engine figures (in flight, up, failures, index blocks)."""
        text = http(self.url + "/metrics")[1]
        return "\n".join(
            line
            for line in text.splitlines()
            if line.startswith("kvsidecar_proxy_") and "{worker=" in line
        )

    def close(self) -> None:
        if self.proxy is not None:
            assert self.proxy.stop(sig_first=True) == 0, "".join(self.proxy.err)[-3000:]
        for proc, _ in self.engines:
            proc.stop()


@pytest.fixture(scope="module")
def fleet(tokenizer: Path) -> Iterator[Fleet]:
    """Three engines shared by the tests that do not depend on what the
    others cached (each uses prompts of its own, and counts deltas)."""
    f = Fleet(tokenizer, 3)
    yield f
    f.close()


@pytest.fixture
def fresh(tokenizer: Path) -> Iterator[Fleet]:
    """Three engines that have served nothing yet."""
    f = Fleet(tokenizer, 3)
    yield f
    f.close()


def complete(url: str, prompt: str, **extra: object) -> dict:
    status, body = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, **extra})
    assert status == 200, body
    return body


def test_a_prompt_goes_where_its_prefix_is_cached(fresh: Fleet) -> None:
    fleet = fresh
    first = complete(fleet.url, PROMPT)["engine"]
    fleet.settle()
    held = fleet.blocks(first)  # the prompt's 6 full blocks
    # No engine holds OTHER: the tie goes to an engine with fewer cached blocks.
    assert complete(fleet.url, OTHER)["engine"] != first
    for suffix in ("What time do you open?", "Do you deliver?", "Gluten-free?"):
        assert complete(fleet.url, PROMPT + suffix)["engine"] == first
    assert fleet.metric("kvsidecar_proxy_overlap_blocks_total") == 3 * held
    assert fleet.metric("kvsidecar_proxy_requests_total", f'{{worker="{first[1:]}"}}') == 4
    assert fleet.metric("kvsidecar_proxy_events_total", '{kind="untokenized_events"}', 0) == 0


def test_chat_is_routed_by_its_rendered_template(fleet: Fleet) -> None:
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Hello?"}]
    status, body = http(fleet.url + "/v1/chat/completions", {"model": "t", "messages": messages})
    assert status == 200
    first = body["engine"]
    fleet.settle()
    more = [*messages, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "?"}]
    status, body = http(fleet.url + "/v1/chat/completions", {"model": "t", "messages": more})
    assert (status, body["engine"]) == (200, first)


def test_a_stream_is_passed_through_as_it_comes(fleet: Fleet) -> None:
    req = urllib.request.Request(
        fleet.url + "/v1/completions",
        data=json.dumps({"prompt": PROMPT, "stream": True, "hold": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=DEADLINE) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        line = resp.readline()  # the engine holds the rest until /release
        assert resp.readline() == b"\n"
        first = json.loads(line.removeprefix(b"data: "))
        assert first["chunk"] == 0
        wid = first["engine"][1:]
        assert fleet.metric("kvsidecar_proxy_in_flight", f'{{worker="{wid}"}}') == 1
        http(fleet.engine_url(first["engine"]) + "/release", method="POST", raw=b"")
        rest = resp.read().decode()
    chunks = [c for c in rest.split("\n\n") if c.startswith("data: ")]
    assert [json.loads(c[6:])["chunk"] for c in chunks[:-1]] == [1, 2]
    assert chunks[-1] == "data: [DONE]"
    wait_for(lambda: fleet.metric("kvsidecar_proxy_in_flight", f'{{worker="{wid}"}}') == 0)


def test_requests_in_flight_count_as_load(fleet: Fleet) -> None:
    prompt = "Load. " + OTHER  # no other test sends it
    first = complete(fleet.url, prompt)["engine"]
    fleet.settle()
    req = urllib.request.Request(
        fleet.url + "/v1/completions",
        data=json.dumps({"prompt": prompt * 3, "stream": True, "hold": True}).encode(),
    )
    with urllib.request.urlopen(req, timeout=DEADLINE) as resp:
        held = json.loads(resp.readline().removeprefix(b"data: "))["engine"]
        assert held == first  # it holds the prefix and nothing is in flight yet
        # Now `first` has a long prompt in flight: a short one sharing the
        # prefix costs less elsewhere than waiting behind it.
        second = complete(fleet.url, prompt + "?")["engine"]
        # (It failed once in a fresh-clone CI run and never alone: say what the proxy saw.)
        assert second != first, "" if second != first else fleet.routing_figures()
        http(fleet.engine_url(first) + "/release", method="POST", raw=b"")
        resp.read()


def test_models_health_and_metrics(fleet: Fleet) -> None:
    status, body = http(fleet.url + "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny"
    health = fleet.health()
    assert health["status"] == "ok"
    assert [w["id"] for w in health["workers"]] == [0, 1, 2]
    assert {w["events"] for w in health["workers"]} == {"vllm"}
    assert fleet.metric("kvsidecar_proxy_engine_up", '{worker="2"}') == 1


def test_bad_bodies_are_refused_and_not_forwarded(fleet: Fleet) -> None:
    def served() -> list[float]:
        return [fleet.metric("kvsidecar_proxy_requests_total", f'{{worker="{w}"}}') for w in "012"]

    def bad() -> float:
        return fleet.metric("kvsidecar_proxy_outcomes_total", '{kind="bad_requests"}', 0)

    served_before, bad_before = served(), bad()
    status, body = http(fleet.url + "/v1/completions", raw=b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = http(fleet.url + "/v1/chat/completions", raw=b"[1, 2]")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert served() == served_before
    assert bad() == bad_before + 2
    # A prompt the tokenizer cannot read is the engine's to judge: routed by load.
    status, body = http(fleet.url + "/v1/completions", {"prompt": {"odd": 1}})
    assert status == 500  # the stand-in fails on it, and the proxy passes that back
    # Token ids past int64 cannot be hashed: routed by load too (before, the
    # proxy's own error, a 500 that reached no engine).
    before = fleet.metric("kvsidecar_proxy_outcomes_total", '{kind="unhashable_prompts"}', 0)
    status, body = http(fleet.url + "/v1/completions", {"model": "tiny", "prompt": [2**64]})
    assert "engine" in body, body  # an engine answered, whatever it made of the ids
    after = fleet.metric("kvsidecar_proxy_outcomes_total", '{kind="unhashable_prompts"}', 0)
    assert after == before + 1


def test_an_engine_down_is_skipped(tokenizer: Path) -> None:
    fleet = Fleet(tokenizer, 2, events=False)
    try:
        fleet.engines[0][0].stop()  # its port is closed now
        for _ in range(3):
            assert complete(fleet.url, PROMPT)["engine"] == "e1"
        assert fleet.metric("kvsidecar_proxy_outcomes_total", '{kind="retries"}') == 1
        assert fleet.metric("kvsidecar_proxy_engine_up", '{worker="0"}') == 0
        assert fleet.health()["workers"][0]["up"] is False
        fleet.engines[1][0].stop()
        status, body = http(fleet.url + "/v1/completions", {"prompt": PROMPT})
        assert status == 503 and body["error"]["message"] == "no engine is up"
        deadline = time.monotonic() + DEADLINE
        while http(fleet.url + "/health")[0] != 503:
            assert time.monotonic() < deadline
    finally:
        fleet.close()


def test_an_engine_silent_before_its_headers_gets_a_504_and_no_retry() -> None:
    with StallingEngine() as a, StallingEngine() as b:
        proxy, url = start_proxy("--read-timeout", "0.5", "--worker", a.url, "--worker", b.url)
        try:
            status, body = http(url + "/v1/completions", {"prompt": PROMPT}, timeout=SILENT)
            assert status == 504, body
            assert body["error"] == {
                "message": "the engine sent no reply within 0.5 s",
                "type": "service_unavailable",
                "code": 504,
            }
            # It may be generating: not sent again elsewhere, and not marked down.
            assert a.accepted + b.accepted == 1
            assert metric(url, "kvsidecar_proxy_outcomes_total", '{kind="timeouts"}') == 1
            assert metric(url, "kvsidecar_proxy_outcomes_total", '{kind="retries"}', 0) == 0
            silent = "0" if a.accepted else "1"
            timeouts = metric(
                url, "kvsidecar_proxy_engine_timeouts_total", f'{{worker="{silent}"}}'
            )
            assert timeouts == 1
            assert metric(url, "kvsidecar_proxy_engine_up", f'{{worker="{silent}"}}') == 1
            assert metric(url, "kvsidecar_proxy_in_flight", f'{{worker="{silent}"}}') == 0
        finally:
            assert proxy.stop(sig_first=True) == 0, "".join(proxy.err)[-3000:]


def test_an_engine_silent_mid_reply_has_the_client_connection_closed() -> None:
    event = b"data: first\n\n"
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(event):x}\r\n".encode()
        + event
        + b"\r\n"
    )
    with StallingEngine(head) as engine:
        proxy, url = start_proxy("--read-timeout", "0.5", "--worker", engine.url)
        try:
            body = json.dumps({"prompt": PROMPT, "stream": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body)
            with urllib.request.urlopen(req, timeout=SILENT) as resp:
                assert resp.status == 200
                assert resp.readline() == b"data: first\n"
                # The 200 is sent: a body that ends before its end is all the proxy can say.
                with pytest.raises(IncompleteRead):
                    resp.read()
            kind = '{kind="truncated_replies"}'
            assert metric(url, "kvsidecar_proxy_outcomes_total", kind) == 1
            assert metric(url, "kvsidecar_proxy_engine_timeouts_total", '{worker="0"}') == 1
            assert metric(url, "kvsidecar_proxy_requests_total", '{worker="0"}') == 0
            assert metric(url, "kvsidecar_proxy_engine_up", '{worker="0"}') == 1
        finally:
            assert proxy.stop(sig_first=True) == 0, "".join(proxy.err)[-3000:]


def test_worker_specs() -> None:
    spec = parse_worker("http://h:8000/,vllm=tcp://h:5557", 3)
    assert (spec.url, spec.worker_id, spec.kind) == ("http://h:8000", 3, "vllm")
    assert spec.source is not None and spec.source.vllm_worker_id == 3
    spec = parse_worker("http://h:1,sidecar=ipc:///a,resync=ipc:///b,id=7", 0)
    assert (spec.worker_id, spec.kind, spec.source.resync_endpoint) == (7, "sidecar", "ipc:///b")
    for bad in (
        "h:8000",
        "http://h:1,foo=1",
        "http://h:1,id=-1",
        "http://h:1,vllm=a,sidecar=b",
        "http://h:1,resync=b",
        "http://h:1,id=1,id=2",
    ):
        with pytest.raises(ValueError):
            parse_worker(bad, 0)
    with pytest.raises(ValueError, match="share worker id"):
        parse_workers(["http://a:1,id=1", "http://b:1,id=1"])
    with pytest.raises(ValueError, match="at least one"):
        parse_workers([])


def test_cli_refusals(tokenizer: Path) -> None:
    cases = [
        ([], "at least one --worker"),
        (["--worker", "http://h:1,vllm=tcp://127.0.0.1:1"], "give --tokenizer"),
        (["--worker", "http://h:1,sidecar=tcp://127.0.0.1:1"], "--namespace"),
        (["--worker", "ftp://h:1"], "http(s)://host:port"),
        (["--worker", "http://h:1", "--tokenizer", "/nonexistent/tok"], "nonexistent"),
        *(
            (["--worker", "http://h:1", "--read-timeout", bad], "--read-timeout must be")
            for bad in ("-1", "nan", "inf")
        ),
    ]
    for args, message in cases:
        out = run_cli("router", "proxy", "--port", "0", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_the_event_thread_waits_when_no_worker_sends_events():
    """With no events endpoint the thread polled no sockets, which returns
    at once: it spun a core, taking the routing lock every turn."""
    from router.proxy_routing import ProxyRouting
    from router.router import Router

    routing = ProxyRouting(parse_workers(["http://127.0.0.1:1"]), Router("radix"))
    turns = 0
    expire = routing.events.subs.expire

    def counted() -> None:
        nonlocal turns
        turns += 1
        expire()

    routing.events.subs.expire = counted  # type: ignore[method-assign]
    routing.start()
    try:
        time.sleep(1.0)  # a bound on the turns, not a wait for a condition
    finally:
        routing.close()
    assert 1 <= turns <= 50  # 100 ms apart: ~10 (the spin made tens of thousands)
