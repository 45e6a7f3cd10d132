"""The `auto` policy in a running sidecar (docs/control-plane.md, "auto"):
every lookup's whole key chain reaches its shadows once, misses included,
whether the engine looked up through the hot index (the rest of the prompt
hashed on the client's own thread) or asked; loads and saves add nothing;
and a sidecar under another policy asks engines for no chains at all."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import sidecar_proc as sp
from sidecar_proc import Sidecar, make_kv, stats_of, tmp_dir, tokens, wait_for

from shm import hotindex

pytestmark = pytest.mark.skipif(not hotindex.AVAILABLE, reason="shm._hotindex is not built")

AUTO = ("--set", "eviction_policy=auto")


def policy(s: Sidecar) -> dict:
    return stats_of(s)["tiers"]["cpu"]["policy"]


def asked_lookups(s: Sidecar) -> int:
    return stats_of(s)["requests"].get("lookup", 0)


def test_hot_lookups_send_their_whole_chains_misses_included(open_client):
    s = Sidecar(*AUTO).start()
    try:
        c = open_client(s.endpoint, make_kv(1))
        assert c._hot_flags() & hotindex.OBSERVED
        assert c.save(tokens(6), np.arange(6)).wait() == 6 * sp.TOKENS_PER_BLOCK
        before = asked_lookups(s)
        assert c.lookup(tokens(6)) == 6 * sp.TOKENS_PER_BLOCK  # every block hit
        assert c.lookup(tokens(40)) == 6 * sp.TOKENS_PER_BLOCK  # 34 blocks past a miss
        assert c.lookup(tokens(200, start=7)) == 0  # the first block misses
        assert c.lookup(tokens(3, tail=5)) == 3 * sp.TOKENS_PER_BLOCK  # a partial block: no key
        assert c.lookup_keys(c.block_keys(tokens(9, start=3))) == 0
        assert c.load(tokens(6), np.arange(10, 16)).wait() == 6 * sp.TOKENS_PER_BLOCK
        wait_for(lambda: policy(s)["observed"] == 5)
        figures = policy(s)
        assert figures["observed_blocks"] == 6 + 40 + 200 + 3 + 9
        assert figures["name"] == "auto" and figures["pending"] == 0
        assert figures["dropped"] == 0
        assert asked_lookups(s) == before  # none of them was asked
        assert c._link.hot.index is not None and c._link.hot.index.tails.dropped == 0
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_bad_token_past_the_first_miss_drops_that_chain_only(open_client):
    """The lookup reads no id past its first miss, so it answers; the tail's
    thread meets the bad id, drops that chain and goes on with the next."""
    s = Sidecar(*AUTO).start()
    try:
        c = open_client(s.endpoint, make_kv(4))
        bad = tokens(20, start=5)
        bad[-1] = -1
        assert c.lookup(bad) == 0  # the first block misses
        assert c.lookup(tokens(12, start=9)) == 0
        wait_for(lambda: policy(s)["observed"] == 1)
        assert policy(s)["observed_blocks"] == 12
        index = c._link.hot.index
        assert index is not None and index.tails.dropped == 1
        assert s.stop() == 0
    finally:
        s.cleanup()


def test_a_lookup_asked_of_the_sidecar_is_observed_there_once(open_client):
    ssd = tmp_dir("ssd")
    s = Sidecar(*AUTO, "--set", f"ssd_dirs={ssd}", "--set", "ssd_capacity_per_dir=8MiB").start()
    try:
        c = open_client(s.endpoint, make_kv(2))
        flags = c._hot_flags()
        assert flags & hotindex.OBSERVED and flags & hotindex.LOWER_TIERS
        assert c.save(tokens(4), np.arange(4)).wait() == 4 * sp.TOKENS_PER_BLOCK
        before = asked_lookups(s)
        assert c.lookup(tokens(4)) == 4 * sp.TOKENS_PER_BLOCK  # a CPU hit: not asked
        assert c.lookup(tokens(30)) == 4 * sp.TOKENS_PER_BLOCK  # a CPU miss: asked
        wait_for(lambda: policy(s)["observed"] == 2)
        assert policy(s)["observed_blocks"] == 4 + 30
        assert asked_lookups(s) == before + 1
        assert s.stop() == 0
    finally:
        s.cleanup()
        shutil.rmtree(ssd, ignore_errors=True)


def test_under_another_policy_no_chain_is_hashed_or_sent(open_client):
    s = Sidecar("--set", "eviction_policy=lru").start()
    try:
        c = open_client(s.endpoint, make_kv(3))
        assert c._hot_flags() and not c._hot_flags() & hotindex.OBSERVED
        assert c.lookup(tokens(50)) == 0
        index = c._link.hot.index
        assert index is not None and index.tails._thread is None
        assert policy(s) == {"name": "lru"}
        c.close()
        assert s.stop() == 0
    finally:
        s.cleanup()
