"""Types of the Linux AIO queue (_aio.c)."""

class Queue:
    def __init__(self, depth: int) -> None: ...
    @property
    def pending(self) -> int:
        """Submitted, not yet reaped."""

    def submit(self, fd: int, buffer: memoryview, offset: int, write: bool, /) -> int:
        """Start one read (into `buffer`) or write (of it) at `offset`; its slot."""

    def wait(self, min_nr: int, /) -> list[tuple[int, int]]:
        """At least `min_nr` completions: (slot, bytes done or -errno)."""

    def close(self) -> None:
        """Wait for what is in flight and free the context."""
