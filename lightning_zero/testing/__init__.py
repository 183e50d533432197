"""Helpers for running code on several gloo ranks in one machine, used by the test suite and the benchmarks.

Public pieces: ``GlooPool``, ``GlooPoolError`` (``pool``: a function on every rank of a warm gloo group), and the
process's own memory from ``/proc``, ``proc_status_bytes``, ``reset_peak_rss`` (``memory``).
"""

from lightning_zero.testing.memory import proc_status_bytes, reset_peak_rss
from lightning_zero.testing.pool import GlooPool, GlooPoolError

__all__ = ["GlooPool", "GlooPoolError", "proc_status_bytes", "reset_peak_rss"]
