"""Benchmark client: load generation over HTTP and latency accounting (docs/bench.md)."""
