"""Engine-side client of the sidecar (arrives with the sidecar issue)."""
