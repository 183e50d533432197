"""Helpers for running code on several gloo ranks in one machine: :class:`~lightning_zero.testing.pool.GlooPool`
(used by the test suite and the benchmarks)."""
