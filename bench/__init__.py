"""Benchmarks behind `kvsidecar bench ...`: ratios to a floor measured in the same run."""
