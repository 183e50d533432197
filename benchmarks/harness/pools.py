"""Where a contender runs: the pool of the project's interpreter, or the pool of an interpreter with DeepSpeed.

Both are :class:`lightning_zero.testing.pool.GlooPool` (the test suite's pool), one per interpreter, started when a
contender first needs it. DeepSpeed is not a dependency of this project: :func:`find_deepspeed_python` names an
interpreter that can import it (the one given, else this one when it can), or ``None`` with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.contenders import CONTENDERS
from lightning_zero.testing.pool import GlooPool

RUN_TASK = "benchmarks.harness.run:run_contender"
_LENT: dict[tuple[str, int], GlooPool] = {}  # (kind, world size) -> a pool lent by the caller (lent())


@contextlib.contextmanager
def lent(pool: GlooPool, kind: str = "main") -> Iterator[None]:
    """While active, a benchmark that needs a ``kind`` pool of ``pool.world_size`` ranks runs in ``pool`` (the test
    suite's warm pool: its smoke tests call a benchmark's ``main`` in process) instead of starting its own; it
    never closes it. The measurements are the same code on warm workers (a lent pool's start-up is not counted)."""
    key = (kind, pool.world_size)
    _LENT[key] = pool
    try:
        yield
    finally:
        del _LENT[key]


def start_pool(world_size: int, kind: str = "main", **kwargs: Any) -> GlooPool:
    """The lent pool of ``kind`` and ``world_size`` (:func:`lent`), else a new :class:`GlooPool` of ``kwargs``."""
    return _LENT.get((kind, world_size)) or GlooPool(world_size, **kwargs)


def stop_pool(pool: GlooPool) -> None:
    """Close ``pool`` unless it was lent."""
    if pool not in _LENT.values():
        pool.close()
STARTUP_TIMEOUT_S = 300.0
DS_ENV = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator, not a CUDA probe


def find_deepspeed_python(given: str | None) -> tuple[str | None, str]:
    """``(interpreter, description)``: ``given`` if it imports DeepSpeed, else this interpreter if it does, else
    ``(None, why)``."""
    if given is None:
        if importlib.util.find_spec("deepspeed") is None:
            return None, (f"DeepSpeed is not importable by {sys.executable} and no --deepspeed-python was given "
                          "(pip install 'lightning_zero[bench]', or point --deepspeed-python at a venv with it)")
        given = sys.executable
    probe = "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"
    try:
        done = subprocess.run([given, "-c", probe], capture_output=True, text=True, timeout=180,
                              env={**os.environ, **DS_ENV}, check=False)  # fmt: skip
    except OSError as e:
        return None, f"cannot run --deepspeed-python {given}: {e}"
    if done.returncode != 0:
        return None, f"{given} cannot import deepspeed: {done.stderr.strip().splitlines()[-1:]}"
    ds_version, torch_version = done.stdout.split()[-2:]
    import torch

    if torch_version != torch.__version__:
        return None, (f"{given} has torch {torch_version}, this interpreter {torch.__version__}: install DeepSpeed "
                      "with torch pinned to the same version")
    where = "this interpreter" if given == sys.executable else "the interpreter of --deepspeed-python"
    return given, f"deepspeed {ds_version} (run by {where})"


class Pools:
    """One gloo pool per interpreter for ``world_size`` ranks; :meth:`run` sends a contender to the right one.

    Args:
        world_size: ranks of every pool.
        threads: torch threads per rank.
        timeout_s: seconds one contender run may take.
        deepspeed_python: interpreter for ``pool="deepspeed"`` contenders (``None``: they cannot run).
    """

    def __init__(self, world_size: int, threads: int, timeout_s: float, deepspeed_python: str | None) -> None:
        self.world_size, self.threads, self.timeout_s = world_size, threads, timeout_s
        self.deepspeed_python = deepspeed_python
        self._pools: dict[str, GlooPool] = {}
        self.startup_s: dict[str, float] = {}  # seconds each pool took to start (spawn, imports, the group)

    def _pool(self, kind: str) -> GlooPool:
        if kind not in self._pools:
            if kind == "deepspeed" and self.deepspeed_python is None:
                raise RuntimeError("a DeepSpeed contender needs --deepspeed-python (see find_deepspeed_python)")
            python = self.deepspeed_python if kind == "deepspeed" and self.deepspeed_python != sys.executable else None
            t = time.perf_counter()
            self._pools[kind] = start_pool(self.world_size, kind, timeout_s=max(self.timeout_s, STARTUP_TIMEOUT_S),
                                           grace_s=10.0, threads=self.threads, python=python,
                                           env=DS_ENV if kind == "deepspeed" else None,
                                           release_groups=kind != "deepspeed")  # DeepSpeed reuses its cached groups
            self.startup_s[kind] = time.perf_counter() - t
        return self._pools[kind]

    def run(self, name: str, config: BenchConfig) -> list[dict[str, Any]]:
        """Run contender ``name`` once on every rank; its measurements by rank."""
        pool = self._pool(CONTENDERS[name].pool)
        return pool.run(RUN_TASK, _timeout_s=self.timeout_s, name=name, config=config)

    def close(self) -> None:
        for pool in self._pools.values():
            stop_pool(pool)
        self._pools = {}
