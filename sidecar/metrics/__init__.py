"""What a running sidecar reports: the figures of `kvsidecar stats` and the
Prometheus endpoint."""
