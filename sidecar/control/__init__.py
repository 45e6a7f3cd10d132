"""The control plane: pure data structures over numpy.

Nothing here imports ZeroMQ, shared memory, torch or threads; every module is
tested on its own. The sidecar's server loop owns one `GlobalCacheEngine` and
feeds it requests and op completions.
"""
