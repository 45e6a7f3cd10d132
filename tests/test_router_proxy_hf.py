"""`kvsidecar router proxy` end to end: two engines running the local tiny
Llama (tests/router_hf_engine.py), each caching its KV in its own real
kvsidecar that publishes KV events; the proxy follows both sidecars' events
and sends each prompt to the engine whose sidecar holds its prefix, where
the prefill then loads it instead of computing it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

from router.prompts import PromptTokenizer
from tests.router_engines import Proc, http, make_tokenizer, start_proxy
from tests.sidecar_proc import Sidecar, wait_for

SYSTEM = (
    "You are the assistant of a bakery with three shops. Opening hours: Monday to Friday "
    "7:00-19:00. Cakes must be ordered two days ahead. Delivery within 5 km. "
)


class HfFleet:
    def __init__(self, tmp: Path, n: int) -> None:
        self.sidecars: list[Sidecar] = []
        self.engines: list[Proc] = []
        self.proxy: Proc | None = None
        tokenizer = make_tokenizer(tmp / "tok")
        self.prompts = PromptTokenizer(tokenizer)
        specs = []
        try:
            for i in range(n):
                s = Sidecar(capacity="8MiB")
                pub, resync = f"ipc://{s.runtime_dir}/ev.pub", f"ipc://{s.runtime_dir}/ev.rs"
                s.args += ["--set", f"events_endpoint={pub}"]
                s.args += ["--set", f"events_resync_endpoint={resync}"]
                s.args += ["--set", f"events_worker_id={i}"]
                self.sidecars.append(s)
                s.start()
                ns = tmp / f"ns{i}.json"
                argv = ["-m", "tests.router_hf_engine", "--sidecar", s.endpoint]
                argv += ["--tokenizer", str(tokenizer), "--name", f"e{i}"]
                argv += ["--namespace-out", str(ns)]
                self.engines.append(Proc(*argv, first_line_has='"url"'))
                url = self.engines[-1].first.split('"url": "')[1].split('"')[0]
                specs += ["--worker", f"{url},sidecar={pub},resync={resync},id={i}"]
            # Every engine registers the same model, so one namespace keys them all.
            assert (tmp / "ns0.json").read_text() == (tmp / f"ns{n - 1}.json").read_text()
            self.proxy, self.url = start_proxy(
                "--tokenizer", str(tokenizer), "--namespace", str(tmp / "ns0.json"), *specs
            )
        except BaseException:
            self.close()
            raise

    def shared_blocks(self, a: str, b: str) -> int:
        """Full blocks of tokens the two prompts start with."""
        ta, tb = (self.prompts.completion({"prompt": p}) for p in (a, b))
        same = next(
            (i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
            min(len(ta), len(tb)),
        )
        return same // 16

    def blocks(self, wid: int) -> int:
        return http(self.url + "/health")[1]["workers"][wid]["blocks"]

    def close(self) -> None:
        if self.proxy is not None:
            assert self.proxy.stop(sig_first=True) == 0, "".join(self.proxy.err)[-3000:]
        for e in self.engines:
            e.stop()
        try:
            for s in self.sidecars:
                if s.proc is not None:
                    assert s.stop() == 0
        finally:
            for s in self.sidecars:
                s.cleanup()


@pytest.fixture
def hf_fleet(tmp_path: Path) -> Iterator[HfFleet]:
    fleet = HfFleet(tmp_path, 2)
    yield fleet
    fleet.close()


def test_prompts_go_to_the_engine_whose_sidecar_holds_their_prefix(hf_fleet: HfFleet) -> None:
    url = hf_fleet.url + "/v1/completions"
    a_prompt, c_prompt = SYSTEM + "When do you open?", SYSTEM + "Do you deliver on Sunday?"
    status, a = http(url, {"model": "tiny", "prompt": a_prompt})
    assert status == 200 and a["loaded_tokens"] == 0 and a["saved_tokens"] > 0
    first = int(a["engine"][1:])
    wait_for(lambda: hf_fleet.blocks(first) == a["saved_tokens"] // 16)
    # A prompt sharing nothing goes to the other engine (fewer cached blocks).
    status, b = http(url, {"model": "tiny", "prompt": "Pack my box with five dozen jugs. " * 4})
    assert status == 200 and int(b["engine"][1:]) != first
    # The follow-up shares the first prompt's prefix: sent where it is cached,
    # and the engine loads it from its sidecar instead of computing it.
    status, c = http(url, {"model": "tiny", "prompt": c_prompt})
    assert status == 200 and int(c["engine"][1:]) == first
    assert c["loaded_tokens"] == hf_fleet.shared_blocks(a_prompt, c_prompt) * 16 > 0
