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
    ``gloo_pool.run("tests.test_x:body", **kwargs)``.
    """
    pool = GlooPool(world_size=2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(autouse=True)
def _session_environment() -> Iterator[None]:
    """Every test starts from the environment the session started with.

    Lightning's in-process fits write launcher variables into ``os.environ`` (``LOCAL_RANK``,
    ``NODE_RANK``, ``MASTER_PORT``, ``PL_GLOBAL_SEED``). A later test that starts a training script
    would hand them on: the script then takes itself for an already launched rank, never starts the
    others, and waits for them until its timeout.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
