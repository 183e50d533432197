"""Benchmarks of lightning_zero (scripts here; their reusable parts in ``benchmarks/harness/``)."""
