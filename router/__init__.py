"""Cluster KV-aware router (arrives with the router issue)."""
