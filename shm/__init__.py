"""CPU-tier block pool in POSIX shared memory (arrives with the sidecar issue)."""
