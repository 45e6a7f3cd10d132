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

from sidecar.control.arc import FREQUENT, LFU, LRU, RECENT, RECENT_SHARE, ArcPolicy
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


def frequent_index() -> tuple[RadixIndex, FakeClock]:
    """Leaves 1..3 in T2: 1 least recent but hit twice, 2 and 3 hit once."""
    clock = FakeClock()
    index = make_index("arc", clock)
    leaves(index, (1, 2, 3), clock)
    hit(index, clock, 10.0, 1)
    hit(index, clock, 11.0, 1)
    hit(index, clock, 12.0, 2)
    hit(index, clock, 13.0, 3)
    return index, clock


def test_the_order_not_followed_marks_its_victim_and_a_hit_on_it_counts_against_that_order():
    index, clock = frequent_index()
    policy = index.policy
    assert policy.order == LRU
    assert evicted(index) == [1]  # LRU's victim; LFU would have taken 2 (one hit, older than 3)
    hit(index, clock, 20.0, 2)  # LFU would have lost this hit
    assert policy.losses == [0.0, 1.0]
    assert policy.order == LRU


def test_the_cache_follows_the_order_that_lost_fewer_hits():
    index, clock = frequent_index()
    policy = index.policy
    assert evicted(index) == [1]  # LRU evicts 1, spares LFU's 2
    leaves(index, range(4, 30), clock)  # T1 fills; T2 (2, 3) now under its share
    index.insert(keys(1), np.array([1]), ready=True)  # back from T2's ghost: LRU lost it
    assert policy.losses == [1.0, 0.0]
    assert policy.order == LFU
    assert policy.recent_share < RECENT_SHARE  # and ARC shrinks the recent queue


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


def test_ghosts_and_spared_marks_stay_bounded():
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
    assert len(policy._spared) <= bound
    assert sum(policy.losses) > 0  # the loop did make both kinds of loss possible


def test_spawn_is_fresh_and_of_the_same_kind():
    policy = ArcPolicy(min_ghost_entries=5)
    policy.losses = [3.0, 1.0]
    policy.order = LFU
    child = policy.spawn()
    assert isinstance(child, ArcPolicy) and child.name == "arc"
    assert child.order == LRU and child.losses == [0.0, 0.0]
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
