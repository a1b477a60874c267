"""Benchmarks: each writes JSON and prints the table that docs/benchmarks.md carries."""
