"""Namespaces through real sidecars (issue 28): a tenant's quota, `kvsidecar
clear --model` in every tier (CPU, SSD, a real Redis), the admin token, a
namespace's TTL, and `kvsidecar namespaces`."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest
import sidecar_proc as sp
from sidecar_proc import Sidecar, connect, make_kv, stats_of, tokens, wait_for

from contract import protocol as p
from engine_shim.channel import Channel, SidecarError

BLOCK = 4096  # the tiny model's 4 KiB blocks


def namespaces(s: Sidecar) -> dict[tuple[str, str], dict]:
    """(model, tenant) -> its row of the stats."""
    return {(r["model"], r["tenant"]): r for r in stats_of(s)["namespaces"]}


def blocks(s: Sidecar, model: str, tier: str, tenant: str = "") -> int:
    row = namespaces(s).get((model, tenant))
    return 0 if row is None else row["tiers"].get(tier, {}).get("blocks", 0)


def kvsidecar(s: Sidecar, *args: str) -> subprocess.CompletedProcess[str]:
    return sp.run_cli(*args, "--instance", s.instance, "--set", f"runtime_dir={s.runtime_dir}")


def test_a_tenant_is_held_to_its_quota_and_evicts_its_own_blocks() -> None:
    s = Sidecar("--set", "namespace_limits=tenant=trial cpu=64KiB").start()  # 16 blocks
    try:
        with (
            connect(s.endpoint, make_kv(1), tenant="trial") as trial,
            connect(s.endpoint, make_kv(2), tenant="paying") as paying,
        ):
            assert paying.save(tokens(24), np.arange(24)).wait() == 24 * sp.TOKENS_PER_BLOCK
            assert trial.save(tokens(12), np.arange(12)).wait() == 12 * sp.TOKENS_PER_BLOCK
            # 12 more: the first prompt's blocks are evicted to stay under 16.
            trial.save(tokens(12, start=5000), np.arange(12, 24)).wait()
            assert blocks(s, "tiny", "cpu", "trial") <= 16
            assert trial.lookup(tokens(12, start=5000)) > 0
            # A prompt larger than the quota stores what fits under it.
            trial.save(tokens(20, start=9000), np.arange(20)).wait()
            assert blocks(s, "tiny", "cpu", "trial") <= 16
            assert blocks(s, "tiny", "cpu", "paying") == 24  # the other tenant untouched
            assert paying.lookup(tokens(24)) == 24 * sp.TOKENS_PER_BLOCK
            row = namespaces(s)[("tiny", "trial")]
            assert row["quota_bytes"] == {"cpu": 64 << 10}
    finally:
        s.stop()


def test_clear_model_removes_that_model_in_every_tier_and_needs_the_token(
    tmp_path, redis_bin
) -> None:
    from redis_servers import RedisServer

    redis = RedisServer().start()
    s = Sidecar(
        "--set",
        f"ssd_dirs={tmp_path / 'ssd'}",
        "--set",
        "ssd_capacity_per_dir=4MiB",
        "--set",
        f"remote_url={redis.url}",
        "--set",
        "write_policy=write_through",
    ).start()
    try:
        other = {"model_name": "other"}
        with connect(s.endpoint, make_kv(1)) as a, connect(s.endpoint, make_kv(2), **other) as b:
            a.save(tokens(6), np.arange(6)).wait()
            b.save(tokens(6), np.arange(6)).wait()

            def written() -> bool:
                st = stats_of(s)
                return (
                    all(
                        blocks(s, m, t) == 6
                        for m in ("tiny", "other")
                        for t in ("cpu", "ssd", "remote")
                    )
                    and st["plans_in_flight"] == 0
                )

            wait_for(written)
            assert redis.client().dbsize() == 12
            # Without the token: refused, nothing changed.
            channel = Channel(s.endpoint, 10.0)
            try:
                with pytest.raises(SidecarError) as info:
                    channel.call(p.Clear(v=p.PROTOCOL_VERSION, id=1, token="guess", model="tiny"))
                assert info.value.code == "forbidden"
            finally:
                channel.close()
            assert blocks(s, "tiny", "cpu") == 6
            done = kvsidecar(s, "clear", "--model", "tiny")
            assert done.returncode == 0, done.stderr
            assert "cpu 6" in done.stdout and "ssd 6" in done.stdout and "remote 6" in done.stdout
            for tier in ("cpu", "ssd", "remote"):
                assert blocks(s, "tiny", tier) == 0
                assert blocks(s, "other", tier) == 6
            wait_for(lambda: redis.client().dbsize() == 6)  # its values purged, the other's kept
            assert a.lookup(tokens(6)) == 0
            assert b.lookup(tokens(6)) == 6 * sp.TOKENS_PER_BLOCK
            listed = kvsidecar(s, "namespaces")
            assert listed.returncode == 0 and "other@r1" in listed.stdout, listed
            assert kvsidecar(s, "clear").returncode == 2  # says what to clear, or --all
            both = kvsidecar(s, "clear", "--all", "--model", "other")  # which did it mean?
            assert both.returncode == 2 and "--all is every namespace" in both.stderr
            assert blocks(s, "other", "cpu") == 6
            assert kvsidecar(s, "clear", "--all", "--tier", "cpu").returncode == 0
            assert blocks(s, "other", "cpu") == 0 and blocks(s, "other", "ssd") == 6
    finally:
        s.stop()
        redis.cleanup()


def test_blocks_past_their_namespace_ttl_are_neither_served_nor_kept() -> None:
    s = Sidecar("--set", "namespace_limits=model=tiny ttl=1").start()
    try:
        with (
            connect(s.endpoint, make_kv(1)) as a,
            connect(s.endpoint, make_kv(2), model_name="x") as b,
        ):
            a.save(tokens(4), np.arange(4)).wait()
            b.save(tokens(4), np.arange(4)).wait()
            assert a.lookup(tokens(4)) == 4 * sp.TOKENS_PER_BLOCK
            wait_for(lambda: a.lookup(tokens(4)) == 0)  # past the TTL: not served
            wait_for(lambda: blocks(s, "tiny", "cpu") == 0)  # and dropped by the loop
            assert b.lookup(tokens(4)) == 4 * sp.TOKENS_PER_BLOCK  # no TTL for model x
            assert namespaces(s)[("tiny", "")]["ttl_seconds"] == 1.0
    finally:
        s.stop()


def test_a_namespace_ttl_holds_in_the_remote_store(redis_bin) -> None:
    """The remote index forgot expired blocks, but the store kept their
    values: the next lookup's probe found them again, as new blocks, and
    they were served past the TTL. Values now carry the TTL (SET ... PX)."""
    from redis_servers import RedisServer

    redis = RedisServer().start()
    s = Sidecar(
        "--set",
        f"remote_url={redis.url}",
        "--set",
        "write_policy=write_through",
        "--set",
        "namespace_limits=model=tiny ttl=2",
    ).start()
    try:
        x = {"model_name": "x"}
        with connect(s.endpoint, make_kv(1)) as a, connect(s.endpoint, make_kv(2), **x) as b:
            a.save(tokens(4), np.arange(4)).wait()
            b.save(tokens(4), np.arange(4)).wait()
            r = redis.client()
            wait_for(lambda: r.dbsize() == 8)  # written through to the store
            ttls = sorted(r.pttl(k) for k in r.keys("*"))
            assert ttls[:4] == [-1] * 4 and all(0 < t <= 2000 for t in ttls[4:])  # x: no TTL
            wait_for(lambda: r.dbsize() == 4)  # tiny's values dropped by the store
            # The CPU tier's copies go within a second of their TTL (the hot
            # index shows them until the loop drops them), and none comes back.
            wait_for(lambda: a.lookup(tokens(4)) == 0)
            assert a.load(tokens(4), np.arange(4)).wait() == 0
            assert b.lookup(tokens(4)) == 4 * sp.TOKENS_PER_BLOCK
    finally:
        s.stop()
        redis.cleanup()


def test_ssd_blocks_keep_their_namespace_and_age_across_a_restart(tmp_path) -> None:
    """The journal records each block's namespace (a tag of its name) and
    when it was written: after a restart an engine's register claims its
    namespace's recovered blocks, whose quota and `clear` then apply, and
    whose TTL counts from the write, not from the restart. (Before, they
    belonged to no namespace until a request extended them: the TTL counted
    from the restart, and no quota or `clear --model` applied.)"""
    ssd = ["--set", f"ssd_dirs={tmp_path / 'ssd'}", "--set", "ssd_capacity_per_dir=4MiB"]
    first = Sidecar(*ssd, "--set", "write_policy=write_through").start()
    x = {"model_name": "x", "tenant": "t"}
    try:
        with (
            connect(first.endpoint, make_kv(1)) as a,
            connect(first.endpoint, make_kv(2), **x) as b,
        ):
            a.save(tokens(4), np.arange(4)).wait()
            b.save(tokens(6), np.arange(6)).wait()
            written = time.time()
            wait_for(
                lambda: (
                    blocks(first, "tiny", "ssd") == 4
                    and blocks(first, "x", "ssd", "t") == 6
                    and stats_of(first)["plans_in_flight"] == 0
                )
            )
        assert first.stop() == 0
    finally:
        first.cleanup()
    # tiny's blocks are past a 1 s TTL now, x's well within an hour's.
    wait_for(lambda: time.time() > written + 1.5)
    limits = "namespace_limits=model=tiny ttl=1,model=x ttl=3600 ssd=16KiB"  # x: 4 blocks
    s = Sidecar(*ssd, "--set", limits, instance=first.instance).start()
    try:
        with connect(s.endpoint, make_kv(None), **x) as b:
            # The geometry's SSD tier opened (10 blocks recovered), and x's
            # claimed at the register, before any request of theirs: held
            # to its quota (its last 2 blocks evicted), young enough.
            assert blocks(s, "x", "ssd", "t") == 4
            assert blocks(s, "(unknown)", "ssd") == 4
            assert b.lookup(tokens(6)) == 4 * sp.TOKENS_PER_BLOCK
            with connect(s.endpoint, make_kv(None)) as a:
                assert a.lookup(tokens(4)) == 0  # written more than its TTL ago
                wait_for(lambda: blocks(s, "tiny", "ssd") == 0)  # and dropped
            done = kvsidecar(s, "clear", "--model", "x")
            assert done.returncode == 0 and "ssd 4" in done.stdout, done
            assert b.lookup(tokens(6)) == 0
        assert stats_of(s)["tiers"]["ssd"]["cached_blocks"] == 0
        assert s.stop() == 0
    finally:
        s.cleanup()
