"""The session's gloo worker pools: :mod:`lightning_zero.testing.pool` (shared with ``benchmarks/``).

This module keeps the import path the tests use (``from tests.pool import GlooPool, GlooPoolError``) and holds
:class:`Pools`, the session's pools by world size (fixtures ``gloo_pool``: 2 ranks, ``gloo_pools``: any size).
"""

from __future__ import annotations

import threading
from typing import Any

from lightning_zero.testing.pool import GlooPool, GlooPoolError, start_fork_server

__all__ = ["GlooPool", "GlooPoolError", "Pools", "start_fork_server"]

LARGE = 8  # a pool of this many ranks or more is started alone (the others closed) and closed after its module


class Pools:
    """The session's pools by world size, each started when a test first asks for it (~6 s of CPU per rank) and
    kept for the later ones: the 3- and 4-rank tests of several files share one start each.

    A pool of :data:`LARGE` ranks or more closes the other extra pools first (memory: ~0.5 GB per rank) and is
    closed by :meth:`close` (``tests/e2e/test_pipeline_tensor_parallel.py`` does after its module). A smaller pool
    that the selected tests ask for is started on the background lane when collection ends (:meth:`prestart`), while
    the unit tests run; a test that asks for it before it is up waits for that start.

    Args:
        environ: the environment every pool's workers get (the session's as it started: a pool started on the lane
            must not take what a test running meanwhile set for itself)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._pools: dict[int, GlooPool] = {}
        self._lock = threading.Lock()  # the lane's thread adds pools too
        self._environ = environ

    def get(self, world_size: int) -> GlooPool:
        """The session's pool of ``world_size`` ranks (started now if it is not running)."""
        with self._lock:
            pool = self._pools.get(world_size)
            if pool is None:
                if world_size >= LARGE:
                    for size in [s for s in self._pools if s != 2]:
                        self._pools.pop(size).close()
                pool = self._pools[world_size] = GlooPool(world_size=world_size, start=False, environ=self._environ)
        pool.start()  # outside the lock: another size's start never waits for this one
        return pool

    def prestart(self, world_size: int, lane: Any) -> None:
        """Start the pool of ``world_size`` ranks (fewer than :data:`LARGE`) on the background lane
        (Note [background lane] in tests/lane.py)."""
        assert world_size < LARGE, "a large pool starts alone, when its module asks for it"
        lane.submit(f"pool of {world_size}", lambda _: self.get(world_size))

    def close(self, world_size: int | None = None) -> None:
        """Close the pool of ``world_size`` ranks (every pool when ``None``)."""
        for size in [world_size] if world_size is not None else list(self._pools):
            with self._lock:
                pool = self._pools.pop(size, None)
            if pool is not None:
                pool.close()
