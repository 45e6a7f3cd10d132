"""The `kvsidecar` command line and the demo: the top of the import graph,
which nothing else in the project imports."""
