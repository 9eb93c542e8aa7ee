"""Evaluations: each approximation (and the exact engine itself) measured against a reference."""
