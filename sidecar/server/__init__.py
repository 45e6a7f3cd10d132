"""The daemon's server: the control loop, its request handlers, the engine
sessions it serves and the KV event publisher."""
