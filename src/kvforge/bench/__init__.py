"""Benchmarks: methods side by side in one process."""
