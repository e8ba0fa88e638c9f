"""Benchmarks: each runs rdmaflow and its peers side by side in one run (see README.md here)."""
