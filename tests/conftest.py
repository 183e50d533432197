"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.pool import GlooPool


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[GlooPool]:
    """A 2-rank gloo worker pool shared by the whole session; started by the first test that asks for it.

    Mark such tests ``@pytest.mark.distributed`` and put their bodies in module-level functions, run with
    ``gloo_pool.run("tests.distributed.test_x:body", **kwargs)`` (the module path of the test file).
    """
    pool = GlooPool(world_size=2)
    try:
        yield pool
    finally:
        pool.close()


_SESSION_ENV = dict(os.environ)  # taken when pytest imports this file: before any test or fixture ran


@pytest.fixture(autouse=True)
def _session_environment() -> Iterator[None]:
    """Every test leaves the environment as the session started with it.

    Lightning's launcher writes ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` and ``LOCAL_RANK``
    into ``os.environ`` even for an in-process fit of one rank. A later test that starts a training
    script would hand them on: the script then takes itself for an already launched rank, never
    starts the others, and waits for them until its timeout.
    """
    yield
    current = os.environ.get("PYTEST_CURRENT_TEST")  # pytest's own, removed by pytest after this
    os.environ.clear()
    os.environ.update(_SESSION_ENV)
    if current is not None:
        os.environ["PYTEST_CURRENT_TEST"] = current
