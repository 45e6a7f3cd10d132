"""RadixIndex: prefix index over chained block keys, for one tier.

Nodes hold runs of blocks (keys and slots in numpy arrays) and split when a
new sequence diverges inside a run. Matching walks one dict lookup and one
vectorised comparison per node, never per block.

Invariants (checked by the property tests):
- a match returns the longest prefix of *ready* blocks; unready blocks are
  in flight and never served;
- an unready node has no children, so dropping it on failure orphans nothing;
- `lock_count` of a node counts locks on it and on its descendants, so a
  locked node and all its ancestors are never evicted;
- only ready, unlocked leaves are eviction candidates, tracked incrementally
  by the policy: O(log n) per evicted node;
- every node below a child of the root has that child's namespace, and
  each namespace's block count is the sum of its nodes' blocks
  (`sidecar/control/namespaces.py`); each namespace's candidates are in its
  own policy instance, namespace 0's being `policy`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from contract.ids import KEY_BYTES, KEY_DTYPE, SLOT_DTYPE, BlockKeys, SlotIds, key_bytes
from sidecar.control.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from sidecar.control.namespaces import Namespace
from sidecar.control.node import RadixNode
from sidecar.control.policies import EvictionPolicy

_EMPTY_SLOTS = SlotIds(np.empty(0, dtype=SLOT_DTYPE))


class IndexConflict(ValueError):
    """A request that would break an index invariant; the index is unchanged."""


class MatchResult(NamedTuple):
    num_blocks: int
    """Leading blocks that are present and ready."""
    slots: SlotIds
    """Their slots, in order."""
    node: RadixNode | None
    """Deepest node holding a matched ready block (lock it to protect the prefix)."""
    num_present: int
    """Leading blocks present at all: ready ones plus any in flight after them."""
    pending: RadixNode | None
    """The unready node met after the ready prefix, if any."""


class InsertResult(NamedTuple):
    node: RadixNode | None
    """The node holding the new blocks (None when nothing was new)."""
    num_new: int


class EvictedRun(NamedTuple):
    key_bytes: bytes
    """Evicted keys, 16 bytes each, back to back."""
    slots: SlotIds
    parent: RadixNode
    """The node the run hung from; still in the index (possibly the root)."""
    ns: int = 0
    """The run's namespace."""


class EvictResult(NamedTuple):
    num_blocks: int
    runs: list[EvictedRun]

    @property
    def slots(self) -> SlotIds:
        if not self.runs:
            return _EMPTY_SLOTS
        return SlotIds(np.concatenate([r.slots for r in self.runs]))


def _common_prefix(node_keys: bytes, query: bytes, pos: int) -> int:
    """Leading keys of `node_keys` equal to the keys of `query` from key `pos`.

    The caller found the node through its first key, so at least one matches.
    A match of the whole node, or of the whole rest of the query (the common
    cases), costs one bytes comparison.
    """
    start = pos * KEY_BYTES
    segment = query[start : start + len(node_keys)]
    n = len(segment) // KEY_BYTES
    if segment == node_keys[: len(segment)]:
        return n
    a = np.frombuffer(node_keys, dtype=np.uint64, count=2 * n)
    b = np.frombuffer(segment, dtype=np.uint64)
    return int(np.flatnonzero(a != b)[0]) // 2


class RadixIndex:
    def __init__(
        self,
        policy: EvictionPolicy,
        clock: Callable[[], float] = time.monotonic,
        record_events: bool = False,
    ) -> None:
        self.policy = policy
        """Namespace 0's policy, and the template of the other namespaces' (`spawn`)."""
        self._spaces: dict[int, Namespace] = {0: Namespace(0, policy)}
        self._ttl_spaces: dict[int, Namespace] = {}
        """The namespaces with a TTL: empty unless one is set, so lookups
        pay one truthiness test for TTLs when there are none."""
        self._clock = clock
        self._seq = 0
        self.root = RadixNode(b"", _EMPTY_SLOTS, None, True, clock(), 0)
        self.num_blocks = 0
        self.num_nodes = 0
        self.fronts_readied = 0
        """Fronts of unready nodes made ready (`set_ready_front`) so far."""
        self.became_evictable = 0
        """Nodes that became eviction candidates (made ready, unlocked, or
        left a leaf by a removal: a discarded save whose slots stay held),
        so far: with the mempool's `vacated`, what tells loads waiting for a
        CPU slot to try again."""
        self._record_events = record_events
        self._events: list[KVEvent] = []
        self.on_ready: Callable[[bytes, SlotIds], None] | None = None
        """Called with a node's keys and slots as its blocks become ready
        (the sidecar publishes them to engines: sidecar/server/hotpath.py)."""

    # ---- lookup -----------------------------------------------------------

    def ready_blocks(self, kb: bytes) -> int:
        """`match(keys).num_blocks` for the keys' raw bytes (a multiple of
        KEY_BYTES): the ready prefix, counted without gathering its slots or
        making an array of the keys; changes nothing. Every lookup of every
        engine runs it on the sidecar's one loop."""
        if self._ttl_spaces and self._expired_top(kb):
            return 0
        children = self.root.children
        pos, total = 0, len(kb) // KEY_BYTES
        while pos < total:
            child = children.get(kb[pos * KEY_BYTES : (pos + 1) * KEY_BYTES])
            if child is None or not child.ready:
                break
            m = _common_prefix(child.key_bytes, kb, pos)
            pos += m
            if m < len(child.slots):
                break
            children = child.children
        return pos

    def match(self, keys: BlockKeys, *, touch: bool = False) -> MatchResult:
        """Longest ready prefix of `keys`. With `touch`, counts a hit on every
        matched node (recency, hit count), first splitting a node the match
        ends inside so its unmatched tail is not refreshed; without `touch`,
        changes nothing.

        A tree whose namespace has a TTL and whose top was born longer ago
        is served as absent (num_blocks 0) but reported present (in
        `num_present`), so nothing is stored over it until `expire`."""
        kb = _key_bytes(keys)
        if self._ttl_spaces and self._expired_top(kb):
            _, present, _ = self._walk(kb)
            return MatchResult(0, _EMPTY_SLOTS, None, present, None)
        node, pos = self.root, 0
        deepest: RadixNode | None = None
        runs: list[np.ndarray] = []
        pending: RadixNode | None = None
        num_present = 0
        total = len(kb) // KEY_BYTES
        while pos < total:
            child = node.children.get(kb[pos * KEY_BYTES : (pos + 1) * KEY_BYTES])
            if child is None:
                break
            m = _common_prefix(child.key_bytes, kb, pos)
            if not child.ready:
                pending, num_present = child, pos + m
                break
            if m < len(child.slots):
                if touch:  # split, so that the unmatched tail keeps its old recency
                    child = self._split(child, m)
                runs.append(child.slots[:m])
                deepest, pos = child, pos + m
                break
            runs.append(child.slots)
            deepest, pos = child, pos + m
            node = child
        if pending is None:
            num_present = pos
        if touch and deepest is not None:
            self._touch_path(deepest)
        slots = runs[0] if len(runs) == 1 else (np.concatenate(runs) if runs else _EMPTY_SLOTS)
        return MatchResult(pos, SlotIds(slots), deepest, num_present, pending)

    def _expired_top(self, kb: bytes) -> bool:
        top = self.root.children.get(kb[:KEY_BYTES])
        if top is None:
            return False
        space = self._ttl_spaces.get(top.ns)
        return space is not None and space.expired(top, self._clock())

    def _touch_path(self, node: RadixNode) -> None:
        now = self._clock()
        self._seq += 1
        seq = self._seq
        policy = self._spaces[node.ns].policy  # one namespace along a path
        while node.parent is not None:
            node.last_access = now
            node.access_seq = seq
            node.hit_count += 1
            policy.on_hit(node)
            if node.heap_token is not None:
                policy.add(node)  # stats changed: refresh its priority
            node = node.parent

    def touch(self, node: RadixNode | None) -> None:
        """Count a hit on `node` and its ancestors, as `match(touch=True)` does."""
        if node is not None:
            self._touch_path(node)

    def path(self, node: RadixNode) -> tuple[BlockKeys, SlotIds]:
        """Keys and slots of every block from the root down to the end of `node`."""
        keys: list[bytes] = []
        slots: list[np.ndarray] = []
        while node.parent is not None:
            keys.append(node.key_bytes)
            slots.append(node.slots)
            node = node.parent
        flat = np.frombuffer(b"".join(reversed(keys)), dtype=KEY_DTYPE)
        run = np.concatenate(slots[::-1]) if slots else _EMPTY_SLOTS
        return BlockKeys(flat), SlotIds(run)

    # ---- insert / ready / remove -------------------------------------------

    def insert(
        self, keys: BlockKeys, slots: SlotIds, *, ready: bool = False, ns: int = 0
    ) -> InsertResult:
        """Add the last len(slots) keys, whose prefix keys[:-len(slots)] must be present.

        The prefix must end in a ready node (an in-flight node gets no
        children). Raises IndexConflict and changes nothing otherwise.

        The new blocks join namespace `ns` when they start a tree; below a
        present prefix they join its tree's namespace (keys are salted by
        namespace, so the tree is right), except that a tree of namespace 0
        (unknown: recovered from disk) is first claimed whole for `ns`.
        """
        kb = _key_bytes(keys)
        total, num_new = len(kb) // KEY_BYTES, len(slots)
        if num_new > total:
            raise IndexConflict(f"{num_new} slots for {total} keys")
        node, pos, m = self._walk(kb)
        if pos != total - num_new:
            raise IndexConflict(
                f"insert expects the first {total - num_new} keys present, found {pos}"
            )
        if num_new == 0:
            return InsertResult(None, 0)
        if not node.ready:
            raise IndexConflict("cannot insert below a block that is still in flight")
        if node.parent is not None:
            if m < len(node):
                node = self._split(node, m)
            if node.ns != ns:
                if ns and not node.ns:
                    self._claim(node, ns)
                ns = node.ns
        space = self._spaces.get(ns) or self._add_space(ns)
        now = self._clock()
        self._seq += 1
        child = RadixNode(
            kb[pos * KEY_BYTES :],
            SlotIds(np.array(slots, dtype=SLOT_DTYPE)),
            node,
            ready,
            now,
            self._seq,
            ns,
        )
        if node.heap_token is not None:
            space.policy.discard(node)
        node.children[child.first_key] = child
        self.num_blocks += num_new
        space.blocks += num_new
        self.num_nodes += 1
        space.policy.on_insert(child)
        if node is self.root:
            space.track(child)
        if ready:
            self._became_ready(child)
        return InsertResult(child, num_new)

    def _add_space(self, ns: int) -> Namespace:
        space = Namespace(ns, self.policy.spawn())
        self._spaces[ns] = space
        return space

    def claim(self, top: RadixNode, ns: int, age: float) -> int:
        """Move the namespace-0 tree `top` (a child of the root) to namespace
        `ns`, its blocks `age` seconds old: a tree recovered from disk whose
        namespace and write time the journal recorded, claimed as that
        namespace registers. Its TTL then counts from that write. Returns its
        blocks. Raises IndexConflict, changing nothing, if `top` is no such
        tree."""
        if top.parent is not self.root or top.ns != 0 or ns == 0:
            raise IndexConflict(f"only a namespace-0 tree can be claimed for a namespace: {top}")
        born = self._clock() - max(0.0, age)
        tree = self._subtree(top)
        for node in tree:  # born is read by TTLs alone
            node.born = born
        self._claim(top, ns)
        return sum(len(node) for node in tree)

    def _claim(self, node: RadixNode, ns: int) -> None:
        """Move the namespace-0 tree holding `node` to namespace `ns`:
        O(tree), once per recovered tree a namespaced request extends."""
        top = node
        while top.parent is not self.root:
            assert top.parent is not None
            top = top.parent
        old, new = self._spaces[top.ns], self._spaces.get(ns) or self._add_space(ns)
        for cur in self._subtree(top):
            candidate = cur.heap_token is not None
            if candidate:
                old.policy.discard(cur)
            old.policy.on_remove(cur)
            old.blocks -= len(cur)
            cur.ns = ns
            new.blocks += len(cur)
            new.policy.on_insert(cur)
            if candidate:
                new.policy.add(cur)
        new.track(top)

    def _walk(self, kb: bytes) -> tuple[RadixNode, int, int]:
        """Deepest node matching the keys `kb` (ready or not), blocks matched
        in all, and blocks matched inside that node."""
        node, pos = self.root, 0
        total = len(kb) // KEY_BYTES
        while pos < total:
            child = node.children.get(kb[pos * KEY_BYTES : (pos + 1) * KEY_BYTES])
            if child is None:
                break
            m = _common_prefix(child.key_bytes, kb, pos)
            node, pos = child, pos + m
            if m < len(child):
                return node, pos, m
        return node, pos, len(node)

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut `node` after its first m blocks; returns the new upper node."""
        parent = node.parent
        assert parent is not None and 0 < m < len(node)
        cut = m * KEY_BYTES
        upper = RadixNode(
            node.key_bytes[:cut], SlotIds(node.slots[:m]), parent, node.ready, 0.0, 0, node.ns
        )
        upper.copy_stats_from(node)
        upper.lock_count = node.lock_count
        node.key_bytes, node.slots = node.key_bytes[cut:], SlotIds(node.slots[m:])
        parent.children[upper.first_key] = upper
        upper.children[node.first_key] = node
        node.parent = upper
        self.num_nodes += 1
        space = self._spaces[node.ns]
        space.policy.on_split(upper, node)
        if parent is self.root:
            space.track(upper)  # the tree's new top
        return upper

    def set_ready(self, node: RadixNode) -> None:
        """The node's data has landed: it becomes visible to matches."""
        if node.ready:
            raise IndexConflict("node is already ready")
        node.ready = True
        self._became_ready(node)

    def set_ready_front(self, node: RadixNode, keep: int) -> None:
        """The data of all but the last `keep` blocks of an unready node has
        landed: those blocks become visible to matches, cut off as a ready
        node above it (the rest stay unready in `node`). Nothing to do once
        at most `keep` blocks are left unready."""
        if node.ready:
            raise IndexConflict("node is already ready")
        if keep <= 0:
            raise ValueError(f"keep must be > 0 (0: set_ready), got {keep}")
        if len(node) > keep:
            upper = self._split(node, len(node) - keep)
            upper.ready = True
            self._became_ready(upper)
            self.fronts_readied += 1

    def _became_ready(self, node: RadixNode) -> None:
        if self.on_ready is not None:
            self.on_ready(node.key_bytes, node.slots)
        if self._record_events:
            parent = node.parent
            parent_key = None if parent is None or parent.parent is None else parent.last_key
            self._events.append(BlockStored(node.keys, parent_key))
        if node.evictable:
            self._spaces[node.ns].policy.add(node)
            self.became_evictable += 1

    def discard(self, node: RadixNode) -> SlotIds:
        """Drop an unready, unlocked node (its data never landed); returns its slots."""
        if node.ready or node.lock_count or node.children or node.parent is None:
            raise IndexConflict(f"only an unready, unlocked leaf can be discarded: {node}")
        self._unlink(node)
        return node.slots

    def _unlink(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.first_key]
        node.parent = None
        n = node.slots.size
        self.num_blocks -= n
        self.num_nodes -= 1
        space = self._spaces[node.ns]
        space.blocks -= n
        policy = space.policy
        policy.on_remove(node)
        if parent.evictable:  # the root never is; any other parent shares the namespace
            policy.add(parent)
            self.became_evictable += 1

    # ---- locks ----------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect node and its ancestors from eviction until `unlock(node)`."""
        if node.heap_token is not None:
            self._spaces[node.ns].policy.discard(node)
        cur: RadixNode | None = node
        while cur is not None:
            cur.lock_count += 1
            cur = cur.parent

    def unlock(self, node: RadixNode) -> None:
        if node.lock_count <= 0:
            raise IndexConflict(f"unlock of an unlocked node: {node}")
        cur: RadixNode | None = node
        while cur is not None:
            cur.lock_count -= 1
            cur = cur.parent
        if node.evictable:
            self._spaces[node.ns].policy.add(node)
            self.became_evictable += 1

    # ---- eviction -------------------------------------------------------------

    def evict(
        self,
        num_blocks: int,
        on_run: Callable[[EvictedRun], None] | None = None,
        *,
        ns: int | None = None,
    ) -> EvictResult:
        """Evict at least `num_blocks` blocks if that many are evictable, whole
        leaves first; the last victim is cut so the total is exactly
        min(num_blocks, evictable). evict(0) does nothing. With `ns`, only
        that namespace's blocks go, in its policy's order; without, every
        victim is the first in the order of all namespaces' policies.

        `on_run` sees each run as it leaves, while its parent is still in the
        index: `path(run.parent)` is its prefix, and locking the parent there
        keeps the parent from being the next victim."""
        runs: list[EvictedRun] = []
        left = num_blocks
        fixed: EvictionPolicy | None = self.policy
        if ns is not None:
            space = self._spaces.get(ns)
            fixed = space.policy if space is not None else None
            if fixed is None:
                return EvictResult(0, runs)
        elif len(self._spaces) > 1:
            fixed = None  # choose per victim across namespaces
        while left > 0:
            policy = fixed if fixed is not None else self._next_victim_policy()
            if policy is None:
                break
            victim = policy.pop()
            if victim is None:
                break
            parent = victim.parent
            assert parent is not None
            if len(victim) > left:
                keep = len(victim) - left
                cut = keep * KEY_BYTES
                tail = SlotIds(victim.slots[keep:])
                runs.append(EvictedRun(victim.key_bytes[cut:], tail, victim, victim.ns))
                policy.on_truncate(victim, left)
                victim.key_bytes = victim.key_bytes[:cut]
                victim.slots = SlotIds(victim.slots[:keep])
                self.num_blocks -= left
                self._spaces[victim.ns].blocks -= left
                policy.add(victim)
                left = 0
            else:
                runs.append(EvictedRun(victim.key_bytes, victim.slots, parent, victim.ns))
                left -= len(victim)
                self._unlink(victim)
            if self._record_events:
                self._events.append(BlockRemoved(_as_keys(runs[-1].key_bytes)))
            if on_run is not None:
                on_run(runs[-1])
        return EvictResult(num_blocks - left, runs)

    def _next_victim_policy(self) -> EvictionPolicy | None:
        """The policy whose next victim comes first in the order of all:
        O(namespaces) per victim."""
        best, best_key = None, None
        for space in self._spaces.values():
            key = space.policy.peek_key()
            if key is not None and (best_key is None or key < best_key):
                best, best_key = space.policy, key
        return best

    def next_victim_age(self) -> float | None:
        """`last_access` of the node `evict` would take next (None: nothing
        is evictable); changes nothing. For S3-FIFO an approximation (see
        `S3FifoPolicy.peek`). Lets an owner of several indexes evict from the
        one whose next victim is oldest."""
        policy = self.policy if len(self._spaces) == 1 else self._next_victim_policy()
        node = policy.peek() if policy is not None else None
        return None if node is None else node.last_access

    @property
    def num_candidates(self) -> int:
        return sum(space.policy.num_candidates for space in self._spaces.values())

    def remove(self, keys: BlockKeys) -> SlotIds:
        """Drop the block `keys[-1]` and every block below it; returns their slots.

        For invalidation (`delete`): a block's descendants are unreachable once
        it is gone, so they go with it. Raises IndexConflict and changes
        nothing unless all of `keys` is present and ready, and nothing from
        `keys[-1]` down is locked or in flight.
        """
        node, m, subtree = self._removal(keys)
        if m > 1:
            self._split(node, m - 1)  # `node` keeps the tail from keys[-1] on
        return _concat(self._drop(subtree))

    def _drop(
        self, subtree: list[RadixNode], keys_out: list[bytes] | None = None
    ) -> list[np.ndarray]:
        """Unlink the nodes of a subtree (listed parents first); their slots
        (and their keys' bytes appended to `keys_out`)."""
        removed: list[np.ndarray] = []
        for victim in reversed(subtree):  # leaves first, so each unlink takes a leaf
            if victim.heap_token is not None:
                self._spaces[victim.ns].policy.discard(victim)
            removed.append(victim.slots)
            if keys_out is not None:
                keys_out.append(victim.key_bytes)
            self._unlink(victim)
            if self._record_events:
                self._events.append(BlockRemoved(victim.keys))
        return removed

    def removable(self, node: RadixNode) -> bool:
        """Whether `remove_from(node, ...)` would succeed."""
        return node.parent is not None and all(
            n.ready and not n.lock_count for n in self._subtree(node)
        )

    def subtree(self, node: RadixNode) -> list[RadixNode]:
        """`node` and its descendants, parents before children."""
        return self._subtree(node)

    def remove_from(self, node: RadixNode, pos: int) -> SlotIds:
        """Drop the blocks of `node`'s run from position `pos` on and every
        block below them; returns their slots. Raises IndexConflict and
        changes nothing unless all of them are ready and unlocked."""
        if not self.removable(node) or not 0 <= pos < len(node):
            raise IndexConflict("the blocks are locked, in flight or not in the index")
        subtree = self._subtree(node)
        if pos:
            self._split(node, pos)  # `node` keeps the tail from `pos` on
        return _concat(self._drop(subtree))

    def check_removable(self, keys: BlockKeys) -> None:
        """Raise IndexConflict if `remove(keys)` would; changes nothing."""
        self._removal(keys)

    def _removal(self, keys: BlockKeys) -> tuple[RadixNode, int, list[RadixNode]]:
        kb = _key_bytes(keys)
        total = len(kb) // KEY_BYTES
        node, pos, m = self._walk(kb)
        if total == 0 or pos != total:
            raise IndexConflict(f"only {pos} of the {total} keys are present")
        subtree = self._subtree(node)
        if node.lock_count or not all(n.ready for n in subtree):
            raise IndexConflict("the blocks are locked or in flight")
        return node, m, subtree

    @staticmethod
    def _subtree(node: RadixNode) -> list[RadixNode]:
        """`node` and its descendants, parents before children."""
        out, stack = [], [node]
        while stack:
            cur = stack.pop()
            out.append(cur)
            stack.extend(cur.children.values())
        return out

    def clear(self, keys_out: list[bytes] | None = None) -> SlotIds:
        """Drop every ready, unlocked block; returns their slots (and appends
        their keys' bytes to `keys_out`). Pending or locked nodes (and their
        ancestors) stay."""
        result = self.evict(self.num_blocks)
        if keys_out is not None:
            keys_out.extend(run.key_bytes for run in result.runs)
        if self._record_events and self.num_blocks == 0:
            self._events.append(AllBlocksCleared())
        return result.slots

    # ---- namespaces -------------------------------------------------------------

    def namespace_blocks(self) -> dict[int, int]:
        """Blocks (ready or in flight) per namespace holding any."""
        return {ns: space.blocks for ns, space in self._spaces.items() if space.blocks}

    def blocks_of(self, ns: int) -> int:
        space = self._spaces.get(ns)
        return space.blocks if space is not None else 0

    def clear_namespace(self, ns: int, keys_out: list[bytes] | None = None) -> tuple[SlotIds, int]:
        """Drop every block of namespace `ns` that is ready, unlocked and has
        nothing locked or in flight below it. Returns their slots (their
        keys' bytes appended to `keys_out`) and the number of the namespace's
        blocks kept (locked, in flight, or above such a block). O(the
        namespace's nodes)."""
        removed: list[np.ndarray] = []
        for top in [c for c in self.root.children.values() if c.ns == ns]:
            removed.extend(self._drop_free_parts(top, keys_out))
        return _concat(removed), self.blocks_of(ns)

    def _drop_free_parts(self, top: RadixNode, keys_out: list[bytes] | None) -> list[np.ndarray]:
        order = self._subtree(top)
        busy: set[int] = set()
        for node in reversed(order):  # children before parents
            if (
                node.lock_count
                or not node.ready
                or any(id(c) in busy for c in node.children.values())
            ):
                busy.add(id(node))
        if id(top) not in busy:
            return self._drop(order, keys_out)
        removed: list[np.ndarray] = []
        for node in order:
            if id(node) in busy:
                for child in [c for c in node.children.values() if id(c) not in busy]:
                    removed.extend(self._drop(self._subtree(child), keys_out))
        return removed

    def set_ttl(self, ns: int, seconds: float | None) -> None:
        """Serve and keep namespace `ns`'s blocks at most `seconds` after
        their insertion (None: no limit). A tree is as old as its top (born
        never decreases down a path): once the top is expired, `match` and
        `ready_blocks` treat the whole tree as absent and `expire` drops it.
        Starting a TTL costs O(children of the root)."""
        space = self._spaces.get(ns) or self._add_space(ns)
        tops = [c for c in self.root.children.values() if c.ns == ns]
        space.set_ttl(seconds, tops)
        if seconds is None:
            self._ttl_spaces.pop(ns, None)
        else:
            self._ttl_spaces[ns] = space

    def ttl(self, ns: int) -> float | None:
        """Namespace `ns`'s TTL in seconds (None: none)."""
        space = self._ttl_spaces.get(ns)
        return None if space is None else space.ttl

    def expire(self, now: float | None = None) -> SlotIds:
        """Drop every expired tree that nothing locks and nothing in it is in
        flight; returns the slots. Trees held back are retried at the next
        call. Cost: O(log n) per tree that comes due plus its nodes."""
        now = self._clock() if now is None else now
        removed: list[np.ndarray] = []
        for space in list(self._ttl_spaces.values()):
            for entry in space.due(now):
                top = entry[2]
                if top.parent is not self.root or top.ns != space.ns:
                    continue  # split (its upper half is queued), gone, or claimed
                subtree = self._subtree(top)
                if top.lock_count or not all(n.ready for n in subtree):
                    space.requeue(entry)
                else:
                    removed.extend(self._drop(subtree))
        return _concat(removed)

    # ---- events ---------------------------------------------------------------

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


def _key_bytes(keys: BlockKeys) -> bytes:
    if not isinstance(keys, np.ndarray) or keys.dtype != KEY_DTYPE or keys.ndim != 1:
        raise TypeError(f"keys must be a 1-D numpy array of dtype {KEY_DTYPE}")
    return key_bytes(keys)


def _concat(runs: list[np.ndarray]) -> SlotIds:
    return SlotIds(np.concatenate(runs)) if runs else _EMPTY_SLOTS


def _as_keys(key_bytes: bytes) -> BlockKeys:
    return BlockKeys(np.frombuffer(key_bytes, dtype=KEY_DTYPE))
