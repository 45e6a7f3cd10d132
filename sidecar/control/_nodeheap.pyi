"""Types of the C candidate heap (_nodeheap.c); same contract as policies.LazyHeap."""

from sidecar.control.node import RadixNode

def next_token() -> int:
    """A heap token no heap in this process has handed out."""

class NodeHeap:
    @property
    def size(self) -> int:
        """Live entries: nodes whose heap_token is set."""

    def push(self, node: RadixNode, k0: float, k1: float, k2: int, /) -> None: ...
    def remove(self, node: RadixNode, /) -> None: ...
    def pop(self) -> RadixNode | None: ...
    def peek(self) -> RadixNode | None:
        """The node `pop` would return, left in place (stale entries on top are dropped)."""
