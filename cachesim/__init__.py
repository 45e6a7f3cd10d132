"""Offline cache studies: request traces, replay through the control plane's
cache engine, Belady's optimum, trace analysis (`kvsidecar analyze`), and the
text tables and progress lines their reports print. The benchmarks and the
analyzer both build on it."""
