"""The contract shared by the engine shim, the sidecar daemon and the router:
the wire protocol, block keys and their hasher, typed ids, where an instance
listens, and the KV event schema. It imports nothing else of the project."""
