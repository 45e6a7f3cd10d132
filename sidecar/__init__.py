"""kvsidecar daemon: configuration, runtime directory, control plane, server, tiers, metrics."""
