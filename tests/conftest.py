"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pool import GlooPool


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[GlooPool]:
    """A 2-rank gloo worker pool shared by the whole session; started by the first test that asks for it.

    Mark such tests ``@pytest.mark.distributed`` and put their bodies in module-level functions, run with
    ``gloo_pool.run("tests.test_x:body", **kwargs)``.
    """
    pool = GlooPool(world_size=2)
    try:
        yield pool
    finally:
        pool.close()
