"""Benchmarks: ``python -m benchmarks.run`` (see run.py)."""
