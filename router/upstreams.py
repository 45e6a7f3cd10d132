"""The engines behind `router proxy`: where each is, where its KV events come
from, and what the proxy knows of it (requests in flight, down until when).

A worker is given on the command line as

    URL[,vllm=EVENTS][,sidecar=PUB][,resync=RESYNC][,id=N]

URL is the engine's OpenAI-compatible server (http://host:port). `vllm=`
follows the engine's own ZMQ KV events (vLLM's `--kv-events-config`
publisher); `sidecar=` (and `resync=`) the events of the kvsidecar the
engine saves through, whose `events_worker_id` must be `id`. Without either,
the worker is routed to by load alone. `id` defaults to the worker's
position on the command line (0, 1, ...).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from router.subscriber import Source

_KEYS = ("vllm", "sidecar", "resync", "id")


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    """The engine's base URL, without a trailing slash."""
    worker_id: int
    source: Source | None
    """Where its KV events come from (None: no events)."""

    @property
    def kind(self) -> str:
        if self.source is None:
            return "none"
        return "sidecar" if self.source.vllm_worker_id is None else "vllm"


def parse_worker(text: str, position: int) -> WorkerSpec:
    """One `--worker` value (ValueError with what is wrong)."""
    url, *rest = text.split(",")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise ValueError(f"--worker wants an http(s)://host:port URL first, got {url!r}")
    opts: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS or not value or key in opts:
            raise ValueError(
                f"--worker {text!r}: {item!r} is not one of {', '.join(k + '=' for k in _KEYS)} "
                "(each at most once)"
            )
        opts[key] = value
    wid = opts.get("id", str(position))
    if not wid.isascii() or not wid.isdigit() or int(wid) >= 2**63:
        raise ValueError(f"--worker {text!r}: id must be an int64 >= 0, got {wid!r}")
    if "vllm" in opts and ("sidecar" in opts or "resync" in opts):
        raise ValueError(f"--worker {text!r}: vllm= and sidecar= exclude each other")
    if "resync" in opts and "sidecar" not in opts:
        raise ValueError(f"--worker {text!r}: resync= goes with sidecar=")
    source = None
    if "vllm" in opts:
        source = Source(opts["vllm"], None, int(wid))
    elif "sidecar" in opts:
        source = Source(opts["sidecar"], opts.get("resync"))
    return WorkerSpec(url.rstrip("/"), int(wid), source)


def parse_workers(texts: list[str]) -> list[WorkerSpec]:
    if not texts:
        raise ValueError("give at least one --worker")
    specs = [parse_worker(t, i) for i, t in enumerate(texts)]
    for attr in ("worker_id", "url"):
        values = [getattr(s, attr) for s in specs]
        dup = next((v for v in values if values.count(v) > 1), None)
        if dup is not None:
            raise ValueError(f"two --worker share {attr.replace('_', ' ')} {dup}")
    return specs


@dataclass
class Upstream:
    """The proxy's view of one engine."""

    spec: WorkerSpec
    in_flight: int = 0
    """Requests sent and not finished."""
    in_flight_blocks: int = 0
    """Their prompt blocks (at least 1 each): the load the cost counts."""
    down_until: float = 0.0
    """time.monotonic() before which it is not tried (it refused a connection)."""
    failures: int = field(default=0)

    def up(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.down_until
