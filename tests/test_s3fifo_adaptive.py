"""The adaptive S3-FIFO: S's share follows ghost hits, within SHARE_BOUNDS.

The victim orders shared with every policy are in test_policies.py; the
queue accounting and the share's bounds under random operations are checked
by test_index_properties.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FakeClock, key_ids, keys, make_index

from sidecar.control.s3fifo import MAIN, SMALL, SMALL_SHARE
from sidecar.control.two_queues import SHARE_BOUNDS


def leaves(index, ids) -> None:
    for i in ids:
        index.insert(keys(i), np.array([i]), ready=True)


def test_a_return_from_the_small_ghost_grows_the_share_by_the_node_over_the_cache():
    index = make_index("s3fifo_adaptive", FakeClock())
    leaves(index, range(1, 21))
    assert key_ids(index.evict(1).runs[0].key_bytes) == [1]  # from S: remembered
    node = index.insert(keys(1), np.array([1]), ready=True).node
    assert node.policy_state.queue == MAIN
    # 19 blocks cached when 1 came back; the main ghost is empty (ratio 1).
    assert index.policy.small_share == pytest.approx(SMALL_SHARE + 1 / 19)


def main_victim(policy: str):
    """An index whose M has just evicted leaf 1 (S's ghost is empty), with 19 leaves left."""
    index = make_index(policy, FakeClock())
    leaves(index, (1, 2, 3))
    for i in (1, 2, 3):
        index.match(keys(i), touch=True)
    # S's pass moves 1, 2, 3 to M with their counts reset; M then evicts 1.
    assert key_ids(index.evict(1).runs[0].key_bytes) == [1]
    leaves(index, range(4, 21))
    return index


def test_a_return_from_the_main_ghost_shrinks_the_share():
    index = main_victim("s3fifo_adaptive")
    node = index.insert(keys(1), np.array([1]), ready=True).node
    assert node.policy_state.queue == MAIN
    assert index.policy.small_share == pytest.approx(SMALL_SHARE - 1 / 19)


def test_plain_s3fifo_forgets_what_main_evicted_and_keeps_its_share():
    index = main_victim("s3fifo")
    node = index.insert(keys(1), np.array([1]), ready=True).node
    assert node.policy_state.queue == SMALL
    assert index.policy.small_share == SMALL_SHARE


def test_the_share_stays_within_its_bounds():
    index = make_index("s3fifo_adaptive", FakeClock())
    leaves(index, (1, 2))
    index.evict(1)  # 1 -> S's ghost
    index.insert(keys(1), np.array([1]), ready=True)  # a whole cache's worth: clamped
    assert index.policy.small_share == SHARE_BOUNDS[1]
    index = main_victim("s3fifo_adaptive")
    index.evict(index.num_blocks)  # everything, S first: S's ghost fills up
    index.insert(keys(1), np.array([1]), ready=True)  # 1 block of 1, times the ghost ratio
    assert index.policy.small_share == SHARE_BOUNDS[0]


# 1 returns from S's ghost when one block is cached: the adaptive share goes
# to its top, so S (5 of 6 blocks) is under it and M's node goes first; plain
# S3-FIFO evicts from S while S holds over 10%.
@pytest.mark.parametrize(
    ("policy", "expected"),
    [("s3fifo", [2, 3, 4, 5, 6, 1]), ("s3fifo_adaptive", [1, 2, 3, 4, 5, 6])],
)
def test_a_larger_share_keeps_s_longer(policy, expected):
    index = make_index(policy, FakeClock())
    leaves(index, (1, 2))
    index.evict(1)  # 1 -> S's ghost
    index.insert(keys(1), np.array([1]), ready=True)  # 1 -> M
    leaves(index, (3, 4, 5, 6))
    assert index.policy.queue_blocks == (5, 1)
    order = [key_ids(index.evict(1).runs[0].key_bytes)[0] for _ in range(6)]
    assert order == expected
    assert index.policy.queue_blocks == (0, 0)
