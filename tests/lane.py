"""The suite's background lane: process-level checks that mostly wait, run beside the in-process tests.

Note [background lane]
    Some checks only processes can show: a rank stopped with SIGSTOP and named after the default 45 s
    ``hang_timeout_s``, a save three hang timeouts long on one rank, a launcher ending a stopped rank. Their wall
    time is mostly waiting (a timeout running out, a sleep, interpreters starting) while the in-process tests of
    the session (the unit tests, which run first: ``tests/conftest.py``) keep one of the two cores busy. Such a
    test is marked ``@pytest.mark.lane(run=run)``: once collection ends, every selected test so marked has ``run``
    submitted here, and two background threads run them in the order the tests run (those marked
    ``sleeps=True``, which mostly sleep for long, first), each in a fresh directory. The test
    asks for the fixture ``lane_result``, which waits for its run (running it there and then when it was not
    submitted) and hands over what it returned, re-raising what it raised; the test asserts on it. Tests that share
    one run (a module fixture's) name it, ``lane(run=run, key=...)``, and the fixture asks the session's ``lane``
    for ``lane.result(key, run)``.

    A ``run`` therefore measures every time it reports itself (a stop's instant, a process's exit) instead of
    leaving it to the test, which may read the result long after; it starts processes, reads their output and
    files and ends every process it started (``finally``). It never runs a task on the session's pools or
    launches, which the main thread uses; it only starts the declared real launches and the 2-, 4- and 3-rank pools
    before the distributed tests (``Pools.prestart``: a start waits for no task; the pools' workers get the
    session's environment as it started, since a unit test running meanwhile may have set variables for itself).
    Nor does it touch what the test process shares among its threads: torch's default generator (a random model
    drawn in a run changed the weights a unit test had just seeded), Hydra's global state, the working directory.
    What needs them runs in a process of its own. A parametrized test's own ``run`` gets the parameters as keyword
    arguments. A test whose ``skip`` or true ``skipif`` marker stops it has no run started.

    A pool task that mostly waits (a rank sleeping, a group's timeout running out) runs on the lane's own 2-rank
    pool: ``lane(run=pool_task("tests.x:body", ...))``. It is started by the first such run, serves one task at a
    time, and is closed with the lane; the session's pools never see it.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

Run = Callable[..., Any]  # run(directory, **params) -> the result the test asserts on


def lane_key(item: pytest.Item) -> str:
    """The key of ``item``'s run: the marker's ``key`` (a run several tests share), else the test's id."""
    marker = item.get_closest_marker("lane")
    return marker.kwargs.get("key", item.nodeid) if marker is not None else item.nodeid


def lane_run(item: pytest.Item) -> Run | None:
    """The run ``item`` is marked with (its parameters bound), ``None`` for a test outside the lane."""
    marker = item.get_closest_marker("lane")
    if marker is None:
        return None
    callspec = getattr(item, "callspec", None)
    if "key" in marker.kwargs or callspec is None:  # a shared run takes no test's parameters
        return marker.kwargs["run"]
    return functools.partial(marker.kwargs["run"], **callspec.params)


class _LanePool:
    """The lane's own 2-rank gloo pool: started by its first task, one task at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Any = None

    def run(self, target: str, kwargs: dict[str, Any]) -> list[Any]:
        from tests.pool import GlooPool

        with self._lock:
            if self._pool is None:
                self._pool = GlooPool(world_size=2)
            return self._pool.run(target, **kwargs)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


_POOL = _LanePool()


def pool_task(target: str, /, **kwargs: Any) -> Run:
    """A run calling ``target`` (``"tests.x:body"``) with ``kwargs`` on every rank of the lane's own 2-rank pool;
    its result is the ranks' results, as ``gloo_pool.run`` gives them (Note [background lane])."""

    def run(directory: Path) -> list[Any]:
        return _POOL.run(target, kwargs)

    return run


class Lane:
    """The session's background runs by test id (Note [background lane])."""

    def __init__(self, workers: int = 2) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="lane_"))
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lane")
        self._runs: dict[str, Future[Any]] = {}

    def submit(self, key: str, run: Run) -> None:
        """Queue ``run`` for the test ``key`` (once)."""
        if key not in self._runs:
            self._runs[key] = self._threads.submit(run, Path(tempfile.mkdtemp(dir=self._root)))

    def result(self, key: str, run: Run) -> Any:
        """What the run for ``key`` returned (its exception re-raised), waiting for it; a run never submitted runs
        now, in this thread."""
        future = self._runs.get(key)
        if future is None:
            return run(Path(tempfile.mkdtemp(dir=self._root)))
        return future.result()

    def close(self) -> None:
        """Drop the runs not started (a session that ended early), wait for the running ones (each ends its own
        processes), and remove their directories."""
        self._threads.shutdown(wait=True, cancel_futures=True)
        _POOL.close()
        shutil.rmtree(self._root, ignore_errors=True)
