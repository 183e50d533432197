"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.launches import SharedLaunches
from tests.pool import GlooPool, Pools


@pytest.fixture(scope="session")
def gloo_pools() -> Iterator[Pools]:
    """The session's gloo worker pools by world size (``gloo_pools.get(4)``), each started by the first test that
    asks for it and shared by the later ones (tests/pool.py)."""
    pools = Pools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture(scope="session")
def gloo_pool(gloo_pools: Pools) -> GlooPool:
    """A 2-rank gloo worker pool shared by the whole session; started by the first test that asks for it.

    Mark such tests ``@pytest.mark.distributed`` and put their bodies in module-level functions, run with
    ``gloo_pool.run("tests.distributed.test_x:body", **kwargs)`` (the module path of the test file).
    """
    return gloo_pools.get(2)


@pytest.fixture(scope="session")
def launches(request: pytest.FixtureRequest) -> Iterator[SharedLaunches]:
    """The session's shared ``lightning-zero`` launches (Note [shared launches] in tests/launches.py): a test that
    only reads what a run wrote asks for the run by its arguments and gets the one the session made."""
    shared = SharedLaunches(lambda world_size: request.getfixturevalue("gloo_pools").get(world_size))
    try:
        yield shared
    finally:
        shared.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="also run the long checks (marked `long`: the 50-launch soak); `pytest -q` skips them")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` run only with ``--long`` (their commands: docs/design.md "Tests")."""
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a long check: run it with --long (docs/design.md, Tests)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


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
