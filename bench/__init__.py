"""Benchmarks: ``python -m bench.<name>``; each prints its figures and the aim they are held to."""
