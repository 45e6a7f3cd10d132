"""A node of the radix index: a run of consecutive blocks of one prefix."""

from __future__ import annotations

import numpy as np

from contract.ids import KEY_BYTES, KEY_DTYPE, BlockKey, BlockKeys, SlotIds


class RadixNode:
    """A run of blocks with one readiness, one lock count and one set of access stats.

    `key_bytes` holds the run's keys back to back (16 bytes each): a node that
    matches whole costs one bytes comparison. `slots` holds its tier slots.
    The root holds no blocks. Invariants kept by `RadixIndex`: an unready
    node has no children; `lock_count` of a node is the number of locks held
    on it or on any descendant; every node below a child of the root has
    that child's namespace `ns` (0: none or unknown); `born` (the clock
    reading when its blocks were inserted) never decreases down a path.
    """

    __slots__ = (
        "access_seq",
        "birth",
        "born",
        "children",
        "heap_token",
        "hit_count",
        "key_bytes",
        "last_access",
        "lock_count",
        "ns",
        "parent",
        "policy_state",
        "ready",
        "slots",
    )

    def __init__(
        self,
        key_bytes: bytes,
        slots: SlotIds,
        parent: RadixNode | None,
        ready: bool,
        now: float,
        seq: int,
        ns: int = 0,
    ) -> None:
        self.key_bytes = key_bytes
        self.slots = slots
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.ready = ready
        self.lock_count = 0
        self.last_access = now
        self.access_seq = seq
        self.birth = seq
        self.born = now
        self.ns = ns
        self.hit_count = 0
        # Owned by the eviction policy: a token marking the node's live heap
        # entry (None: not a candidate), and any per-policy fields.
        self.heap_token: int | None = None
        self.policy_state: object = None

    def __len__(self) -> int:
        return self.slots.size

    @property
    def keys(self) -> BlockKeys:
        return BlockKeys(np.frombuffer(self.key_bytes, dtype=KEY_DTYPE))

    @property
    def first_key(self) -> bytes:
        return self.key_bytes[:KEY_BYTES]

    @property
    def last_key(self) -> BlockKey:
        return BlockKey(self.key_bytes[-KEY_BYTES:])

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def evictable(self) -> bool:
        return self.ready and self.lock_count == 0 and not self.children and self.parent is not None

    def copy_stats_from(self, other: RadixNode) -> None:
        self.last_access = other.last_access
        self.access_seq = other.access_seq
        self.birth = other.birth
        self.born = other.born
        self.hit_count = other.hit_count
        self.policy_state = other.policy_state

    def __repr__(self) -> str:
        state = "ready" if self.ready else "pending"
        return f"RadixNode({len(self)} blocks, {state}, locks={self.lock_count})"
