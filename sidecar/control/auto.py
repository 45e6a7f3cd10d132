"""`auto`: the real cache follows whichever candidate policy does best lately.

Every candidate policy (`shadows.CANDIDATES`) keeps its own structure over
the real candidates at all times: every hook the index calls is forwarded
to all of them, so each one's order (queues, counts, ghosts) is always that
of the live cache, and a switch throws nothing away. A victim is popped from
the chosen candidate and dropped from the others; those that keep ghosts
remember it as a victim of the queue it sat in (`TwoQueues.evicted_elsewhere`),
as if they had chosen it. Which candidate is chosen is the `Selector`'s
decision (`sidecar/control/shadows.py`): miniature simulations of every
candidate over the requests the tier sees.

Policies keep their per-node state in `node.heap_token` and
`node.policy_state`, one of each per node; so each candidate sees each node
through a `_View` of its own, whose stats and keys are the real node's and
whose two policy fields are the view's. The real node's `policy_state` holds
its views, one per candidate, and its `heap_token` says whether it is a
candidate (the index reads only that).

Cost: every hook runs once per candidate, and a victim costs one pop and a
discard per other candidate; the shadows cost about one index operation per
candidate per sampled request (`shadows.py`).
"""

from __future__ import annotations

from typing import Any

from sidecar.control import shadows
from sidecar.control.node import RadixNode
from sidecar.control.policies import EvictionPolicy, make_policy
from sidecar.control.shadows import Selector
from sidecar.control.two_queues import TwoQueues


def _through(field: str) -> Any:
    """A property of a view that reads and writes the real node's `field`."""
    return property(
        lambda view: getattr(view.real, field),
        lambda view, value: setattr(view.real, field, value),
    )


class _View(RadixNode):
    """One candidate policy's handle on a real node: the real node's keys,
    slots and stats, its own `heap_token` and `policy_state`."""

    __slots__ = ("real",)

    key_bytes = _through("key_bytes")
    slots = _through("slots")
    parent = _through("parent")
    children = _through("children")
    ready = _through("ready")
    lock_count = _through("lock_count")
    last_access = _through("last_access")
    access_seq = _through("access_seq")
    birth = _through("birth")
    born = _through("born")
    ns = _through("ns")
    hit_count = _through("hit_count")

    def __init__(self, real: RadixNode) -> None:  # no super(): the fields are the real node's
        self.real = real
        self.heap_token = None
        self.policy_state = None


class AutoPolicy(EvictionPolicy):
    """Evicts in the order of the candidate the shared `Selector` chooses."""

    name = "auto"

    def __init__(self, selector: Selector | None = None) -> None:
        self.selector = selector if selector is not None else Selector(shadows.CANDIDATES)
        self.observer = self.selector
        self.members = tuple(make_policy(n) for n in self.selector.names)
        self._num_candidates = 0

    @staticmethod
    def views(node: RadixNode) -> tuple[_View, ...]:
        state = node.policy_state
        assert isinstance(state, tuple)
        return state

    @property
    def chosen(self) -> str:
        return self.selector.chosen_name

    # --- the index's hooks, forwarded to every candidate ----------------------

    def on_insert(self, node: RadixNode) -> None:
        node.policy_state = views = tuple(_View(node) for _ in self.members)
        for member, view in zip(self.members, views, strict=True):
            member.on_insert(view)

    def on_hit(self, node: RadixNode) -> None:
        for member, view in zip(self.members, self.views(node), strict=True):
            member.on_hit(view)

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        # `upper` copied `lower`'s stats, views included: it gets its own.
        upper.policy_state = uppers = tuple(_View(upper) for _ in self.members)
        for member, up, low in zip(self.members, uppers, self.views(lower), strict=True):
            member.on_split(up, low)

    def on_remove(self, node: RadixNode) -> None:
        for member, view in zip(self.members, self.views(node), strict=True):
            member.on_remove(view)

    def on_truncate(self, node: RadixNode, num_blocks: int) -> None:
        for member, view in zip(self.members, self.views(node), strict=True):
            member.on_truncate(view, num_blocks)

    def add(self, node: RadixNode) -> None:
        for member, view in zip(self.members, self.views(node), strict=True):
            member.add(view)
        if node.heap_token is None:
            self._num_candidates += 1
            node.heap_token = 1

    def discard(self, node: RadixNode) -> None:
        if node.heap_token is None:
            return
        for member, view in zip(self.members, self.views(node), strict=True):
            member.discard(view)
        node.heap_token = None
        self._num_candidates -= 1

    # --- choosing victims: the chosen candidate's ------------------------------

    def pop(self) -> RadixNode | None:
        chosen = self.selector.chosen
        popped = self.members[chosen].pop()
        if popped is None:
            return None
        assert isinstance(popped, _View)
        node = popped.real
        for i, (member, view) in enumerate(zip(self.members, self.views(node), strict=True)):
            if i != chosen:
                if isinstance(member, TwoQueues):
                    member.evicted_elsewhere(view)
                member.discard(view)
        node.heap_token = None
        self._num_candidates -= 1
        return node

    def peek(self) -> RadixNode | None:
        view = self.members[self.selector.chosen].peek()
        return view.real if isinstance(view, _View) else None

    def peek_key(self) -> tuple[float, float, int] | None:
        # Namespaces share the selector, so their keys are of one kind.
        return self.members[self.selector.chosen].peek_key()

    def spawn(self) -> AutoPolicy:
        return AutoPolicy(self.selector)

    @property
    def num_candidates(self) -> int:
        return self._num_candidates
