"""`engine_shim/call_metrics.py`: a KVClient's lookup, load and save calls
are counted in `kvsidecar_client_call_seconds{op=...}` in the process's
default prometheus-client registry (what an engine exports); without
prometheus-client the client works and records nothing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from prometheus_client import REGISTRY, generate_latest
from sidecar_proc import ROOT, TOKENS_PER_BLOCK, Sidecar, connect, make_kv, tokens


def calls(op: str) -> float:
    value = REGISTRY.get_sample_value("kvsidecar_client_call_seconds_count", {"op": op})
    return value or 0.0


def test_the_client_histogram_counts_its_calls():
    before = {op: calls(op) for op in ("lookup", "load", "save")}
    s = Sidecar().start()
    try:
        with connect(s.endpoint, make_kv(1)) as c:
            for i in range(3):
                assert c.save(tokens(2, start=1000 * i), np.arange(2)).wait() > 0
            for _ in range(5):
                assert c.lookup(tokens(2)) == 2 * TOKENS_PER_BLOCK
            assert c.load(tokens(2), np.arange(4, 6)).wait() == 2 * TOKENS_PER_BLOCK
        assert s.stop() == 0
    finally:
        s.cleanup()
    after = {op: calls(op) for op in ("lookup", "load", "save")}
    assert {op: after[op] - before[op] for op in after} == {"lookup": 5, "load": 1, "save": 3}
    text = generate_latest(REGISTRY).decode()
    assert 'kvsidecar_client_call_seconds_bucket{le="0.001",op="lookup"}' in text
    assert REGISTRY.get_sample_value("kvsidecar_client_call_seconds_sum", {"op": "lookup"}) > 0


def test_a_lookup_the_sidecar_does_not_answer_is_counted_too():
    from engine_shim import KVClient

    before = calls("lookup")
    s = Sidecar().start()
    try:
        c = connect(s.endpoint, make_kv(1), timeout=0.5)
        assert s.stop() == 0
        assert c.lookup(tokens(2)) == 0  # the cache is an optimisation: 0, not an error
        c.close()
    finally:
        s.cleanup()
    assert calls("lookup") - before == 1
    assert KVClient.lookup.__doc__  # the decorated methods keep their docs


def test_without_prometheus_client_nothing_is_recorded():
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from engine_shim import call_metrics\n"
        "from engine_shim.client import KVClient\n"
        "call_metrics.OBSERVE['lookup'](0.5)\n"
        "assert call_metrics.timed_call('save')(lambda: 3)() == 3\n"
        "assert 'prometheus_client' not in {m for m, v in sys.modules.items() if v}\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
