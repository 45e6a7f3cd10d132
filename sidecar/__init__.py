"""kvsidecar daemon: configuration, control plane, server loop, worker pools, CLI."""
