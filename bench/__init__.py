"""Benchmarks and comparison runs (DESIGN §7)."""
