"""Cluster KV-aware router: a global index of the KV blocks every worker
holds, fed by KV events, and the choice of a worker for each request. See
docs/router.md; the Python API is `router.router.Router`."""
