"""The CPU-tier block pool in shared memory, and the engine-side copies into it.

- `shm.layout`: `BlockLayout`, where each byte of a KV block lives in a slot.
- `shm.names`: segment names (POSIX shm or file paths), their validation,
  and removal of stale ones.
- `shm.segments`: opening, creating and removing one segment; where a pool may go.
- `shm.pages`: the memory filesystem under a pool and the pages it actually got.
- `shm.pool`: `ShmPool`, segments created by the sidecar and attached by engines.
- `shm.copy`: `save_blocks` / `load_blocks` between paged KV tensors and slots.

None of these imports torch at module level.
"""
