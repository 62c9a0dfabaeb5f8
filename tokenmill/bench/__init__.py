"""Benchmark machinery shared by `benchmarks/*.py` and `tokenmill bench`: the standard workloads
of shared/README.md and the serving load generator."""
