"""arc: ARC's two queues over radix leaves, the frequent queue's order learned.

The victim orders shared with every policy are in test_policies.py; the
queue accounting and the share's bounds under random operations are checked
by test_index_properties.py; the last test runs it in a real sidecar."""

from __future__ import annotations

import numpy as np
import pytest
import sidecar_proc as sp
from helpers import FakeClock, chain, key_ids, keys, make_index
from sidecar_proc import Sidecar, connect, make_kv, stats_of, tokens

from sidecar.control.arc import FREQUENT, MIN_AGING_HITS, RECENT, RECENT_SHARE, ArcPolicy
from sidecar.control.index import RadixIndex


def leaves(index: RadixIndex, ids, clock: FakeClock | None = None) -> None:
    for i in ids:
        if clock is not None:
            clock.set(float(i))
        index.insert(keys(i), np.array([i]), ready=True)


def hit(index: RadixIndex, clock: FakeClock, t: float, *ids: int) -> None:
    for i in ids:
        clock.set(t)
        assert index.match(keys(i), touch=True).num_blocks == 1


def evicted(index: RadixIndex, n: int = 1) -> list[int]:
    return [k for run in index.evict(n).runs for k in key_ids(run.key_bytes)]


def test_a_hit_moves_a_node_to_the_frequent_queue_and_one_hit_wonders_go_first():
    clock = FakeClock()
    index = make_index("arc", clock)
    leaves(index, range(1, 5), clock)
    hit(index, clock, 10.0, 1)
    policy = index.policy
    assert isinstance(policy, ArcPolicy)
    assert policy.queue_blocks == (3, 1) and policy.queue_candidates == (3, 1)
    assert evicted(index, 3) == [2, 3, 4]  # T1 first, least recent first, though 1 is older
    assert evicted(index) == [1]


def test_a_return_from_the_recent_ghost_grows_the_share_and_enters_the_frequent_queue():
    index = make_index("arc", FakeClock())
    leaves(index, range(1, 21))
    assert evicted(index) == [1]  # from T1: remembered
    node = index.insert(keys(1), np.array([1]), ready=True).node
    assert node.policy_state.queue == FREQUENT
    # 19 blocks cached when 1 came back; T2's ghost is empty (ratio 1).
    assert index.policy.recent_share == pytest.approx(RECENT_SHARE + 1 / 19)


def test_the_frequent_queue_evicts_the_fewest_own_hits_first():
    clock = FakeClock()
    index = make_index("arc", clock)
    leaves(index, (1, 2, 3), clock)
    hit(index, clock, 10.0, 1)
    hit(index, clock, 11.0, 1)  # 1: two hits, least recent
    hit(index, clock, 12.0, 2)
    hit(index, clock, 13.0, 3)
    assert index.policy.queue_blocks == (0, 3)
    assert evicted(index, 3) == [2, 3, 1]


def test_counts_halve_once_per_aging_epoch_so_old_popularity_fades():
    clock = FakeClock()
    index = make_index("arc", clock)
    leaves(index, (1, 2), clock)
    policy = index.policy
    for t in range(8):
        hit(index, clock, 10.0 + t, 1)  # 1: eight hits
    hit(index, clock, 20.0, 2)
    assert (policy.freq(index.root.children[keys(1).tobytes()]), policy.epoch) == (8, 0)
    assert evicted(index) == [2]  # fewer hits, though more recent
    leaves(index, (2,), clock)
    hit(index, clock, 21.0, 2)
    # MIN_AGING_HITS own hits (on other leaves) end the epoch: 1's count halves.
    for i in range(3, 3 + MIN_AGING_HITS):
        leaves(index, (i,))
        hit(index, clock, 22.0, i)
    assert policy.epoch == 1
    node = index.root.children[keys(1).tobytes()]
    assert policy.freq(node) == 4
    for t in range(6):  # 2 passes 1 only because 1 aged
        hit(index, clock, 100.0 + t, 2)
    victims = evicted(index, index.num_blocks)
    assert victims.index(1) < victims.index(2)


def test_only_the_deepest_node_of_a_match_counts_a_hit_for_lfu():
    clock = FakeClock()
    index = make_index("arc", clock)
    index.insert(chain(2), np.arange(2), ready=True)
    index.insert(chain(4), np.arange(2, 4), ready=True)  # a child below blocks 1..2
    clock.set(1.0)
    index.match(chain(4), touch=True)
    upper = index.root.children[chain(1).tobytes()]
    lower = next(iter(upper.children.values()))
    assert (upper.policy_state.freq, lower.policy_state.freq) == (0, 1)
    assert upper.policy_state.queue == lower.policy_state.queue == FREQUENT


def test_ghosts_stay_bounded():
    clock = FakeClock()
    index = RadixIndex(ArcPolicy(min_ghost_entries=8), clock)
    policy = index.policy
    for i in range(1, 400):
        clock.set(float(i))
        index.insert(keys(i), np.array([i]), ready=True)
        if i % 3 == 0:
            index.match(keys(i), touch=True)
            index.match(keys(i - 1), touch=True)
        if index.num_blocks > 10:
            index.evict(1)
        if i % 7 == 0 and index.match(keys(i // 2)).num_blocks == 0:  # evicted, back
            index.insert(keys(i // 2), np.array([i]), ready=True)
    bound = max(8, index.num_nodes + 1)
    assert all(len(g) <= bound for g in policy._ghosts)
    assert policy.recent_share != RECENT_SHARE  # the loop did bring evicted nodes back


def test_spawn_is_fresh_and_of_the_same_kind():
    index = make_index("arc", FakeClock())
    leaves(index, range(1, 21))
    index.evict(1)
    index.insert(keys(1), np.array([1]), ready=True)  # the share moved
    policy = index.policy
    child = policy.spawn()
    assert isinstance(child, ArcPolicy) and child.name == "arc"
    assert child.recent_share == RECENT_SHARE != policy.recent_share
    assert child.num_candidates == 0 and child.queue_blocks == (0, 0)
    assert child.peek() is None and child.peek_key() is None and child.pop() is None


def test_peek_names_the_next_victim_and_its_key_is_its_age():
    clock = FakeClock()
    index = make_index("arc", clock)
    leaves(index, (1, 2, 3), clock)
    node = index.policy.peek()
    assert key_ids(node.key_bytes) == [1]
    assert index.policy.peek_key() == (node.last_access, 0.0, node.access_seq)
    assert evicted(index) == [1]
    assert node.policy_state.queue == RECENT


def test_a_sidecar_with_arc_keeps_a_reused_prompt_while_one_hit_prompts_churn():
    import torch

    s = Sidecar("--set", "eviction_policy=arc", capacity="1MiB").start()  # 256 blocks
    src, dst = make_kv(1), make_kv(None)
    try:
        with (
            connect(s.endpoint, src) as writer,
            connect(s.endpoint, dst, hot_path=False) as reader,
        ):
            hot = tokens(8)
            assert writer.save(hot, np.arange(8)).wait() == 8 * sp.TOKENS_PER_BLOCK
            assert reader.load(hot, np.arange(8)).wait() == 8 * sp.TOKENS_PER_BLOCK  # a hit: T2
            for i in range(1, 41):  # 320 blocks seen once: T1, evicted before the hot prompt
                prompt = tokens(8, start=500 * i)
                assert writer.save(prompt, np.arange(8, 16)).wait() == 8 * sp.TOKENS_PER_BLOCK
            assert reader.load(hot, np.arange(8, 16)).wait() == 8 * sp.TOKENS_PER_BLOCK
            assert all(torch.equal(x[8:16], y[:8]) for x, y in zip(dst, src, strict=True))
            assert reader.lookup(tokens(8, start=500)) == 0  # the oldest one-hit prompt went
            assert stats_of(s)["tiers"]["cpu"]["used_blocks"] <= 256
    finally:
        s.stop()
