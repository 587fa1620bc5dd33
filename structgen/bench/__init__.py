"""Benchmarks shipped with the package so `structgen bench NAME` can run them; `benchmarks/NAME.py` wraps each.

Every module here exposes `main(argv: Sequence[str] | None = None) -> int`, measures its baseline in the same
run, prints a table of ratios, and can write its numbers as JSON.
"""
