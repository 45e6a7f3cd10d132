"""The metrics port of a real `kvsidecar serve`, read over HTTP as a
Prometheus scraper or a probe would: `/metrics` (counters with the values
the traffic made, request histograms counting every request, build info,
the process collector), `/healthz`, `/readyz` (200 when started, 503 while
draining) and 404 elsewhere; with an SSD directory and a real Redis server,
the SSD and remote histograms count their jobs."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_servers import RedisServer, ensure_redis
from sidecar_proc import (
    MODEL,
    TOKENS_PER_BLOCK,
    Sidecar,
    connect,
    free_port,
    make_kv,
    tokens,
)

from contract import protocol as p
from engine_shim import KVClient
from engine_shim.channel import Channel, SidecarUnavailable
from sidecar.metrics.http_server import version

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape_until(port: int, done: Callable[[Samples], bool], timeout: float = 20.0) -> Samples:
    """The metrics once `done` holds (the snapshot they come from is
    published by the control loop a few times a second)."""
    deadline = time.monotonic() + timeout
    while True:
        status, text = get(port, "/metrics")
        assert status == 200
        found = samples(text)
        if done(found):
            return found
        assert time.monotonic() < deadline, "metrics did not reach the expected values"
        time.sleep(0.05)


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def op(name: str) -> tuple[tuple[str, str], ...]:
    return (("op", name),)


def tier(name: str) -> tuple[tuple[str, str], ...]:
    return (("tier", name),)


def test_probes_and_unknown_paths():
    port = free_port()
    s = Sidecar("--metrics-port", str(port)).start()  # returns once it printed it serves
    try:
        assert get(port, "/healthz") == (200, "ok\n")
        assert get(port, "/readyz") == (200, "ready\n")
        for path in ("/nope", "/", "/metrics/x", "/favicon.ico"):
            assert get(port, path)[0] == 404, path
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_an_ipv6_metrics_host_is_bracketed_in_the_start_up_line():
    port = free_port()
    s = Sidecar("--metrics-port", str(port), "--set", "metrics_host=::1").start()
    try:
        assert f"metrics on http://[::1]:{port}/metrics" in s.banner
        with urllib.request.urlopen(f"http://[::1]:{port}/healthz", timeout=10) as reply:
            assert reply.read() == b"ok\n"
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_metrics_host_that_cannot_be_bound_is_named_in_one_line():
    port = free_port()
    s = Sidecar("--metrics-port", str(port), "--set", "metrics_host=256.1.1.1")
    try:
        with pytest.raises(RuntimeError) as info:
            s.start()
    finally:
        s.cleanup()
    assert s.proc is not None and s.proc.returncode == 1
    lines = str(info.value).split(": ", 1)[1].splitlines()
    assert len(lines) == 1, lines
    assert f"cannot start: metrics_host=256.1.1.1 metrics_port={port}: [Errno" in lines[0]


def test_counters_and_histograms_count_the_traffic():
    port = free_port()
    s = Sidecar("--metrics-port", str(port)).start()
    try:
        with connect(s.endpoint, make_kv(1), hot_path=False) as c:  # counts requests
            assert c.save(tokens(2), np.arange(2)).wait() == 2 * TOKENS_PER_BLOCK
            assert c.lookup(tokens(4)) == 2 * TOKENS_PER_BLOCK  # 2 hits, 2 misses
            assert c.lookup(tokens(1)) == TOKENS_PER_BLOCK  # 1 hit
            assert c.load(tokens(3), np.arange(10, 13)).wait() == 2 * TOKENS_PER_BLOCK
            stats = c.stats()
        block_bytes = stats["tiers"]["cpu"]["block_bytes"]
        assert stats["latency"]["lookup"]["count"] == 2  # `kvsidecar stats` has them too
        assert stats["transfers"]["loaded_blocks"] == 2
        m = scrape_until(
            port,
            lambda m: (
                m.get(("kvsidecar_loads_total", ())) == 1
                and m.get(("kvsidecar_request_seconds_count", op("lookup"))) == 2
            ),
        )
        expected = {
            ("kvsidecar_lookups_total", ()): 2,
            ("kvsidecar_lookup_blocks_total", ()): 5,
            ("kvsidecar_lookup_hit_blocks_total", tier("cpu")): 3,
            ("kvsidecar_lookup_miss_blocks_total", tier("cpu")): 2,
            ("kvsidecar_lookup_hit_bytes_total", tier("cpu")): 3 * block_bytes,
            ("kvsidecar_lookup_miss_bytes_total", tier("cpu")): 2 * block_bytes,
            ("kvsidecar_saves_total", ()): 1,
            ("kvsidecar_saved_blocks_total", ()): 2,
            ("kvsidecar_loads_total", ()): 1,
            ("kvsidecar_loaded_blocks_total", ()): 2,
            ("kvsidecar_requests_total", op("lookup")): 2,
            ("kvsidecar_requests_total", op("save")): 1,
            ("kvsidecar_requests_total", op("load")): 1,
            ("kvsidecar_request_seconds_count", op("lookup")): 2,
            ("kvsidecar_request_seconds_count", op("load")): 1,
            ("kvsidecar_request_seconds_count", op("save")): 1,
            ("kvsidecar_tier_evicted_blocks_total", tier("cpu")): 0,
            ("kvsidecar_tier_used_blocks", tier("cpu")): 2,
            ("kvsidecar_build_info", (("version", version()),)): 1,
        }
        assert {key: m.get(key) for key in expected} == expected
        for name in ("lookup", "load", "save"):
            inf = ("kvsidecar_request_seconds_bucket", (("le", "+Inf"), ("op", name)))
            assert m[inf] == m["kvsidecar_request_seconds_count", op(name)]
            assert 0 < m["kvsidecar_request_seconds_sum", op(name)] < 10
        assert m["process_resident_memory_bytes", ()] > 0
        assert any(name == "python_info" for name, _ in m)
        assert any(name == "python_gc_objects_collected_total" for name, _ in m)
        _, text = get(port, "/metrics")
        assert 'kvsidecar_request_seconds_bucket{le="0.001",op="lookup"}' in text
        assert "# TYPE kvsidecar_lookup_hit_blocks_total counter" in text
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_every_count_is_a_counter_and_every_level_a_gauge():
    port = free_port()
    s = Sidecar("--metrics-port", str(port)).start()
    try:
        with connect(s.endpoint, make_kv(1)) as c:
            c.save(tokens(1), np.arange(1)).wait()
        scrape_until(port, lambda m: m.get(("kvsidecar_saves_total", ())) == 1)
        _, text = get(port, "/metrics")
        types = {f.name: f.type for f in text_string_to_metric_families(text)}
        ours = {name: kind for name, kind in types.items() if name.startswith("kvsidecar_")}
        counters = {
            "kvsidecar_lookups", "kvsidecar_lookup_blocks", "kvsidecar_lookup_hit_blocks",
            "kvsidecar_lookup_miss_blocks", "kvsidecar_lookup_hit_bytes",
            "kvsidecar_lookup_miss_bytes", "kvsidecar_loads", "kvsidecar_loaded_blocks",
            "kvsidecar_saves", "kvsidecar_saved_blocks", "kvsidecar_requests", "kvsidecar_errors",
            "kvsidecar_tier_evicted_blocks", "kvsidecar_expired_sessions",
            "kvsidecar_loop_lapses",
        }  # fmt: skip
        gauges = {
            "kvsidecar_tier_capacity_bytes", "kvsidecar_tier_capacity_blocks",
            "kvsidecar_tier_used_blocks", "kvsidecar_tier_cached_blocks", "kvsidecar_hit_ratio",
            "kvsidecar_window_hit_ratio", "kvsidecar_plans_in_flight", "kvsidecar_engines",
            "kvsidecar_build_info",
        }  # fmt: skip
        assert {n: ours.get(n) for n in counters} == dict.fromkeys(counters, "counter")
        assert {n: ours.get(n) for n in gauges} == dict.fromkeys(gauges, "gauge")
        assert ours["kvsidecar_request_seconds"] == "histogram"
        # The parser strips `_total` from a counter's family: a gauge keeps it.
        assert not [n for n, kind in ours.items() if kind == "gauge" and n.endswith("_total")]
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_readyz_is_503_while_draining():
    port = free_port()
    s = Sidecar("--metrics-port", str(port), "--set", "drain_seconds=60").start()
    try:
        with connect(s.endpoint, make_kv(1)) as c:
            # A save whose copies are never reported: a plan in flight holds the drain.
            channel = Channel(s.endpoint, 5.0)
            keys = c.block_keys(tokens(2))
            save = p.Save(v=p.PROTOCOL_VERSION, id=0, session=c.session)
            reply, _ = channel.call(save, [p.keys_frame(keys), p.ids_frame(np.arange(2))])
            assert reply.ops
            assert get(port, "/readyz")[0] == 200
            assert s.proc is not None
            s.terminate()
            wait_for(lambda: get(port, "/readyz") == (503, "not ready\n"))
            assert get(port, "/healthz") == (200, "ok\n")  # alive while it drains
            channel.close()
        # The client's unregister gave the plan up: the drain ends at once.
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_an_engine_registering_while_the_sidecar_drains_registers_with_the_next_one():
    """A refusal by a sidecar that is shutting down is no answer (a rolling
    restart): the registration stays, and is made with the sidecar that
    answers next (before, it was dropped, and SGLang's attach failed)."""
    s = Sidecar("--set", "drain_seconds=60").start()
    refused: list[KVClient] = []

    def refused_while_draining() -> bool:
        """A client registered (the SIGTERM not seen yet) or refused."""
        client = KVClient.connect(s.endpoint, timeout=5.0)
        try:
            client.register(make_kv(2), **MODEL)
        except SidecarUnavailable as err:
            assert "shutting down" in str(err)
            refused.append(client)
            return True
        client.close()
        return False

    try:
        with connect(s.endpoint, make_kv(1)) as c:
            channel = Channel(s.endpoint, 5.0)  # a plan in flight holds the drain
            save = p.Save(v=p.PROTOCOL_VERSION, id=0, session=c.session)
            keys = c.block_keys(tokens(2))
            channel.call(save, [p.keys_frame(keys), p.ids_frame(np.arange(2))])
            assert s.proc is not None
            s.terminate()
            wait_for(refused_while_draining)
            (late,) = refused
            assert late._link.register_args is not None  # kept
            channel.close()
        assert s.stop() == 0
        s.start()
        try:

            def answered() -> bool:  # once its socket has reconnected
                try:
                    return late.stats()["pid"] != 0
                except SidecarUnavailable:
                    return False

            wait_for(answered)
            assert late.save(tokens(2), np.arange(2)).wait() == 2 * TOKENS_PER_BLOCK
            assert late.lookup(tokens(2)) == 2 * TOKENS_PER_BLOCK
        finally:
            late.close()
        assert s.stop() == 0
    finally:
        s.cleanup()


@pytest.fixture(scope="module")
def redis_server():
    ensure_redis()
    server = RedisServer().start()
    yield server
    server.cleanup()


def test_ssd_and_remote_histograms_count_their_jobs(tmp_path, redis_server):
    ports = free_port(), free_port()
    hosts = [
        Sidecar(
            "--metrics-port",
            str(port),
            "--set",
            f"remote_url={redis_server.url}",
            "--set",
            f"ssd_dirs={tmp_path / f'ssd{i}'}",
            "--set",
            "ssd_capacity_per_dir=16MiB",
            capacity="1MiB",
        )
        for i, port in enumerate(ports)
    ]
    try:
        a, b = (h.start() for h in hosts)
        with connect(a.endpoint, make_kv(1)) as c:

            def settled() -> bool:
                stats = c.stats()
                return stats["plans_in_flight"] == 0 and all(
                    stats["tiers"][t]["ops_in_flight"] == 0 for t in ("ssd", "remote")
                )

            c.save(tokens(8), np.arange(8)).wait()
            wait_for(settled)
            # Newer blocks push the first 8 out of the 1 MiB CPU tier; SSD keeps them.
            start = 1000
            while c.lookup_tiers(tokens(8)).cpu:
                c.save(tokens(64, start=start), np.arange(64)).wait()
                wait_for(settled)
                start += 64 * TOKENS_PER_BLOCK
                assert start < 20 * 64 * TOKENS_PER_BLOCK, "the CPU tier never evicted"
            assert c.lookup_tiers(tokens(8)).ssd == 8 * TOKENS_PER_BLOCK
            assert c.load(tokens(8), np.arange(8)).wait() == 8 * TOKENS_PER_BLOCK  # from SSD
            stats = c.stats()
        ssd = stats["tiers"]["ssd"]["latency"]
        assert ssd["read"]["count"] >= 1 and ssd["write"]["count"] >= 1
        assert stats["tiers"]["remote"]["latency"]["put"]["count"] >= 1
        m = scrape_until(
            ports[0],
            lambda m: (
                m.get(("kvsidecar_ssd_io_seconds_count", op("read")), 0) >= ssd["read"]["count"]
            ),
        )
        for name, kind in (
            ("kvsidecar_ssd_io_seconds", "read"),
            ("kvsidecar_ssd_io_seconds", "write"),
            ("kvsidecar_remote_io_seconds", "put"),
        ):
            count = m[f"{name}_count", op(kind)]
            assert count >= 1, (name, kind)
            assert m[f"{name}_bucket", (("le", "+Inf"), ("op", kind))] == count
        assert m["kvsidecar_ssd_checksum_failures_total", ()] == 0
        assert m["kvsidecar_lookup_hit_blocks_total", tier("ssd")] >= 8
        # Another host finds the blocks in the store and loads them from there.
        with connect(b.endpoint, make_kv(None)) as c:
            assert c.lookup(tokens(8)) == 8 * TOKENS_PER_BLOCK  # a probe of the store
            assert c.load(tokens(8), np.arange(8)).wait() == 8 * TOKENS_PER_BLOCK
            assert c.stats()["tiers"]["remote"]["latency"]["get"]["count"] >= 1
        m = scrape_until(
            ports[1], lambda m: m.get(("kvsidecar_remote_io_seconds_count", op("get")), 0) >= 1
        )
        assert m["kvsidecar_loaded_blocks_total", ()] == 8
        assert m["kvsidecar_lookup_hit_blocks_total", tier("remote")] == 8
        assert m["kvsidecar_remote_online", ()] == 1
        for h in (a, b):
            assert h.stop() == 0
    finally:
        for h in hosts:
            h.cleanup()


def test_idle_metrics_connections_by_the_hundred_leave_the_engines_served():
    """The metrics port shares the sidecar's file descriptors with the
    engines' socket: idle connections past its limit made libzmq abort the
    sidecar at the next engine's connect. Past MAX_CONNECTIONS they are now
    closed at once, and an idle one is closed after IDLE_SECONDS."""
    import resource
    import socket

    from sidecar.metrics.http_server import MAX_CONNECTIONS

    port = free_port()
    s = Sidecar("--metrics-port", str(port)).start()
    idle: list[socket.socket] = []
    try:
        assert s.proc is not None
        resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (200, 200))
        for _ in range(300):
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            idle.append(conn)
        # The ones past the cap were closed unanswered: they read EOF.
        wait_for(lambda: sum(closed(c) for c in idle) >= len(idle) - MAX_CONNECTIONS)
        with connect(s.endpoint, make_kv(3)) as client:  # a new connection to the sidecar
            assert client.save(tokens(2), np.arange(2)).wait() == 2 * TOKENS_PER_BLOCK
        assert s.proc.poll() is None
        for conn in idle:
            conn.close()
        wait_for(lambda: answers(port))
        assert s.stop() == 0
    finally:
        for conn in idle:
            conn.close()
        s.cleanup()


def closed(conn) -> bool:
    """Whether the peer closed `conn` (EOF waiting), without blocking."""
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def answers(port: int) -> bool:
    try:
        return get(port, "/healthz") == (200, "ok\n")
    except OSError:  # closed unanswered: every connection is still taken
        return False
