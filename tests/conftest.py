"""Shared pytest fixtures."""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.lane import Lane, lane_key, lane_run
from tests.launches import SharedLaunches
from tests.pool import GlooPool, Pools, start_fork_server

_SESSION_ENV = dict(os.environ)  # taken when pytest imports this file: before any test or fixture ran
_LANE = Lane()  # Note [background lane] in tests/lane.py
_LAUNCHES = SharedLaunches()  # the fixture `launches`; its declared real launches start on the lane
# the fixtures `gloo_pools` and `gloo_pool`; the 2-, 4- and 3-rank pools start on the lane, with the session's
# environment (a unit test running meanwhile may have set variables for itself)
_POOLS = Pools(environ=_SESSION_ENV)
# the tiers in the order they run: the in-process unit tests first, beside the lane's runs (one core each)
_TIERS = ("unit", "distributed", "e2e")


@pytest.fixture(scope="session")
def gloo_pools() -> Iterator[Pools]:
    """The session's gloo worker pools by world size (``gloo_pools.get(4)``), each started by the first test that
    asks for it (or on the lane: ``pytest_collection_finish``) and shared by the later ones (tests/pool.py)."""
    try:
        yield _POOLS
    finally:
        _POOLS.close()


@pytest.fixture(scope="session")
def gloo_pool(gloo_pools: Pools) -> GlooPool:
    """A 2-rank gloo worker pool shared by the whole session; started on the lane when collection ends (or by the
    first test that asks for it).

    Mark such tests ``@pytest.mark.distributed`` and put their bodies in module-level functions, run with
    ``gloo_pool.run("tests.distributed.test_x:body", **kwargs)`` (the module path of the test file).
    """
    return gloo_pools.get(2)


@pytest.fixture(scope="session")
def launches(request: pytest.FixtureRequest) -> Iterator[SharedLaunches]:
    """The session's shared ``lightning-zero`` launches (Note [shared launches] in tests/launches.py): a test that
    only reads what a run wrote asks for the run by its arguments and gets the one the session made."""
    _LAUNCHES.pools = lambda world_size: request.getfixturevalue("gloo_pools").get(world_size)
    yield _LAUNCHES


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="also run the long checks (marked `long`: the 50-launch soak); `pytest -q` skips them")


def _tier(item: pytest.Item) -> int:
    parts = item.path.relative_to(item.config.rootpath).parts
    return _TIERS.index(parts[1]) if len(parts) > 2 and parts[1] in _TIERS else len(_TIERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The unit tests run first, then the distributed ones, then end-to-end (each in its files' order: Note
    [background lane] in tests/lane.py). Tests marked ``long`` run only with ``--long`` (their commands:
    docs/design.md "Tests")."""
    items.sort(key=_tier)  # stable: the order within a tier stays
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a long check: run it with --long (docs/design.md, Tests)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The lane's runs of the selected tests start (Note [background lane] in tests/lane.py)."""
    if session.config.option.collectonly:
        return
    items = [item for item in session.items if not _skipped(item)]
    fixtures = {name for item in items for name in getattr(item, "fixturenames", ())}
    asked = {name for item in items for name in _arguments(item)}  # the extra pools: a test asks for gloo_pools
    pools = [size for size, used in ((2, {"gloo_pool", "gloo_pools", "launches"} & fixtures),
                                     (4, {"gloo_pools"} & asked), (3, {"gloo_pools"} & asked)) if used]
    # first what mostly sleeps for long, then in the order the tests need them: the pools the distributed tests
    # start with (each start ~6 s of CPU per rank) before their own runs
    if pools:
        start_fork_server()  # here, with the session's environment: the pools' workers fork from it
    for item in [item for item in items if _sleeps(item)]:
        _LANE.submit(lane_key(item), lane_run(item))
    for item in items:
        if pools and _tier(item) > 0:
            for size in pools:
                _POOLS.prestart(size, _LANE)
            pools = []
        run = lane_run(item)
        if run is not None:
            _LANE.submit(lane_key(item), run)  # once: a second submit of a key is ignored
        for marker in item.iter_markers("real_launch"):
            _LAUNCHES.prestart(marker.args[0], _LANE)
    for size in pools:
        _POOLS.prestart(size, _LANE)


def _skipped(item: pytest.Item) -> bool:
    """Marked ``skip``, or ``skipif`` with a condition that holds (its runs must not start on the lane)."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(bool(m.args[0]) for m in item.iter_markers("skipif") if m.args and isinstance(m.args[0], bool))


def _arguments(item: pytest.Item) -> tuple[str, ...]:
    """The fixtures the test function names itself (not those its fixtures ask for)."""
    function = getattr(item, "function", None)
    return tuple(inspect.signature(function).parameters) if function is not None else ()


def _sleeps(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("lane")
    return marker is not None and marker.kwargs.get("sleeps", False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _LANE.close()
    _LAUNCHES.close()


@pytest.fixture
def lane_result(request: pytest.FixtureRequest) -> object:
    """What this test's background run returned (Note [background lane] in tests/lane.py): mark the test
    ``@pytest.mark.lane(run=run)``."""
    run = lane_run(request.node)
    assert run is not None, f"{request.node.nodeid} asks for lane_result without @pytest.mark.lane(run=...)"
    return _LANE.result(lane_key(request.node), run)


@pytest.fixture(scope="session")
def lane() -> Lane:
    """The session's background lane, for a fixture that shares one run among tests (``lane.result(key, run)``;
    the tests carry ``@pytest.mark.lane(run=run, key=key)``: Note [background lane] in tests/lane.py)."""
    return _LANE




@pytest.fixture(autouse=True)
def _session_environment() -> Iterator[None]:
    """Every test leaves the environment as the session started with it.

    Lightning's launcher writes ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` and ``LOCAL_RANK``
    into ``os.environ`` even for an in-process fit of one rank. A later test that starts a training
    script would hand them on: the script then takes itself for an already launched rank, never
    starts the others, and waits for them until its timeout. Only what changed is put back: the lane's
    threads copy ``os.environ`` for the processes they start (Note [background lane] in tests/lane.py).

    A module a test imported from a temporary directory (a user project's ``wave.model``, copied for the test)
    is forgotten with the directory's place on ``sys.path``: a later test importing the same name from its own
    copy gets its own, as a fresh process would.
    """
    modules, path = set(sys.modules), list(sys.path)
    yield
    current = os.environ.get("PYTEST_CURRENT_TEST")  # pytest's own, removed by pytest after this
    for key in [k for k in os.environ if k not in _SESSION_ENV and k != "PYTEST_CURRENT_TEST"]:
        del os.environ[key]
    for key, value in _SESSION_ENV.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    if current is not None:
        os.environ["PYTEST_CURRENT_TEST"] = current
    temporary = tempfile.gettempdir() + os.sep
    for name in set(sys.modules) - modules:
        if (getattr(sys.modules.get(name), "__file__", None) or "").startswith(temporary):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p in path or not p.startswith(temporary)]
