"""The session's gloo worker pool: :mod:`lightning_zero.testing.pool` (shared with ``benchmarks/``).

This module keeps the import path the tests use (``from tests.pool import GlooPool, GlooPoolError``).
"""

from lightning_zero.testing.pool import GlooPool, GlooPoolError

__all__ = ["GlooPool", "GlooPoolError"]
