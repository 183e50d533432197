"""Commands run in this process, their ranks in the session's pool: what ``launches.pool_cli`` and the docs test
run instead of a process of their own (Note [shared launches] in tests/launches.py).

- :func:`run_in_process`: ``lightning-zero <args>`` through ``lightning_zero.cli.main``; with a pool, the run's
  ranks run the worker's code there (:func:`launch_in_pool`, pool body :func:`rank_main`).
- :func:`run_script_in_pool`: ``python <script>`` as ``__main__`` on every rank of a pool (:func:`script_main`),
  for a script of 2 ranks; :func:`run_script_in_process` for a script of one process.

Each captures the output at the file-descriptor level and shows warnings as a fresh process would
(:func:`fresh_warnings`).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.launches import Launch


# ------------------------------------------------------------------------------------------ the CLI's ranks in the pool
@contextlib.contextmanager
def _fds_to(stdout: Path, stderr: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (and so ``sys.stdout`` / ``sys.stderr``, and C++ writes) into two files."""
    saved = [os.dup(1), os.dup(2)]
    files = [open(stdout, "wb"), open(stderr, "wb")]  # noqa: SIM115 - closed below
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for f in files:
            f.close()


@contextlib.contextmanager
def fresh_warnings() -> Iterator[None]:
    """Warnings shown as in a fresh process: printed to ``sys.stderr`` (not recorded by pytest), Python's
    once-per-location registries and Lightning's once-per-process ``WarningCache`` sets empty (a warm pool worker
    showed each only in its first task)."""
    import warnings

    from lightning_utilities.core.rank_zero import WarningCache

    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in ("lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics"):
            for value in list(vars(module).values()):
                if type(value) is WarningCache:  # type(): no attribute of a lazy module is touched
                    value.clear()

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():  # entering it invalidates every module's registry of warnings already shown
        warnings.simplefilter("default")  # Python's default for a script; pytest's filters do not apply there
        warnings.showwarning = show
        yield


def rank_main(config_file: str, command: str = "fit", project_dir: str | None = None,
              cwd: str | None = None) -> dict[str, Any]:
    """Pool body: one rank of ``lightning_zero.config.run.worker`` on ``config_file``; returns its stdout and stderr.

    As ``worker.main`` minus ``close_all()``: the pool releases the groups a task leaves (Note [groups left by
    tasks] in lightning_zero/testing/pool.py) and keeps its own. Warnings show as in a fresh rank
    (:func:`fresh_warnings`). ``project_dir``: the launcher's ``$LIGHTNING_ZERO_PROJECT_DIR``, which a real launch's
    ranks inherit (the pool restores its environment after the task); ``cwd``: the launcher's working directory, where
    a real launch's ranks start (a relative ``model.path`` is read from there)."""
    import torch.distributed as dist

    from lightning_zero.config.run.worker import run_rank
    from lightning_zero.project.locate import PROJECT_ENV

    if project_dir:
        os.environ[PROJECT_ENV] = project_dir

    rank = dist.get_rank()  # the ranks of a task share its working directory
    out, err = Path(f"rank{rank}.stdout").resolve(), Path(f"rank{rank}.stderr").resolve()
    if cwd:
        os.chdir(cwd)  # the pool returns to its own directory after the task
    failure, code = None, None
    with _fds_to(out, err), fresh_warnings():
        try:
            code = run_rank(Path(config_file), command)
        except BaseException:  # the output first, then the traceback (as a rank's stderr would end)
            import traceback

            failure = traceback.format_exc()
            sys.stderr.write(failure)
    result = {"stdout": out.read_text(errors="replace"), "stderr": err.read_text(errors="replace"), "code": code}
    if failure is not None:
        raise RuntimeError(f"{failure}\n----- the rank's output -----\n{result['stdout']}{result['stderr']}")
    return result


def _pool_of(pools: Any, world_size: int) -> Any:
    """``pools``: a pool, or a callable giving the pool of a world size (``gloo_pools.get``)."""
    pool = pools(world_size) if callable(pools) and not hasattr(pools, "run") else pools
    assert pool.world_size == world_size, f"a run of {world_size} ranks in a pool of {pool.world_size}"
    return pool


@contextlib.contextmanager
def launch_in_pool(pools: Any) -> Iterator[None]:
    """While active, ``lightning-zero train`` runs its ranks in a pool instead of under torchrun.

    ``pools``: the pool, or a callable that gives the pool of a run's world size (``gloo_pools.get``). The ranks'
    stderr goes through the launcher's :class:`~lightning_zero.config.run.console.RankConsole` (the console and
    ``train.log``) as under torchrun, rank 0's first; their stdout goes to this process's stdout. The launcher's
    line names the torchrun command the real launch would have run. A rank that raises fails the launch with
    :class:`~lightning_zero.config.run.launch.RankFailure`."""
    import lightning_zero.config.run.launch as launch
    from lightning_zero.config.run.console import RankConsole
    from lightning_zero.project.locate import PROJECT_ENV
    from tests.pool import GlooPoolError

    def launch_ranks(config_file: Path, devices: int, node: object = None, command: str = launch.FIT,
                     env_extra: dict[str, str] | None = None) -> None:
        assert node is None, "the pool runs one node"
        if env_extra:  # read at a process's start (glibc's malloc settings): the warm ranks started long ago
            saved(config_file, devices, node, command, env_extra)
            return
        pool = _pool_of(pools, devices)
        launch.log.info("launching %d ranks: %s", devices,
                        " ".join(launch.torchrun_command(config_file, devices, None, command)))
        console = RankConsole(config_file.parent / "train.log")
        try:
            try:
                ranks = pool.run("tests.in_pool:rank_main", config_file=str(config_file), command=command,
                                 project_dir=os.environ.get(PROJECT_ENV), cwd=os.getcwd())
            except GlooPoolError as err:
                console.feed(f"{err}\n")
                raise launch.RankFailure(f"a rank failed in the test pool; its output is in "
                                         f"{config_file.parent / 'train.log'}") from err
            for rank in ranks:
                for line in rank["stderr"].splitlines(keepends=True):
                    console.feed(line)
                sys.stdout.write(rank["stdout"])
        finally:
            console.close()
        if any(rank["code"] for rank in ranks):  # as launch_ranks: a UsageError, printed once by rank 0
            assert {rank["code"] for rank in ranks} == {launch.USAGE_EXIT}, [rank["code"] for rank in ranks]
            raise launch.RankFailure("the ranks refused the configuration (the error above); nothing was trained. "
                                     f"Full output: {config_file.parent / 'train.log'}.", launch.USAGE_EXIT)

    saved = launch.launch_ranks
    launch.launch_ranks = launch_ranks  # type: ignore[assignment]
    try:
        yield
    finally:
        launch.launch_ranks = saved  # type: ignore[assignment]


def run_in_process(args: Sequence[str], cwd: Path, pool: Any = None) -> Launch:
    """``lightning-zero <args>`` through ``lightning_zero.cli.main`` in this process, in ``cwd``; with ``pool`` (a
    pool or ``gloo_pools.get``), a multi-rank run's ranks run there (:func:`launch_in_pool`)."""
    from lightning_zero.cli import main

    cwd.mkdir(parents=True, exist_ok=True)
    out, err = io.StringIO(), io.StringIO()
    previous, environ = os.getcwd(), dict(os.environ)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), fresh_warnings(), \
                (launch_in_pool(pool) if pool is not None else contextlib.nullcontext()):
            code = main(list(args))
    finally:
        os.chdir(previous)
        os.environ.clear()
        os.environ.update(environ)
    return Launch(tuple(args), cwd, code, out.getvalue(), err.getvalue())


# ------------------------------------------------------------------------------------------ scripts in the pool
def script_main(path: str, argv: list[str], cwd: str) -> dict[str, Any]:
    """Pool body: ``python <path> <argv>`` on this rank, in ``cwd``: the script runs as ``__main__`` (Lightning finds
    the pool's group and rank variables and starts no process); returns its exit code (``SystemExit``'s, 1 for an
    exception, whose traceback ends its stderr, as an interpreter would print it) and output."""
    import runpy
    import traceback

    import torch.distributed as dist

    rank = dist.get_rank()
    out, err = Path(f"rank{rank}.stdout").resolve(), Path(f"rank{rank}.stderr").resolve()
    code, saved_argv, saved_path, previous = 0, sys.argv, list(sys.path), os.getcwd()
    with _fds_to(out, err), fresh_warnings():
        sys.argv = [path, *argv]
        sys.path.insert(0, str(Path(path).parent))  # as `python <path>` puts the script's folder first
        os.chdir(cwd)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException:
            code = 1
            sys.stderr.write(traceback.format_exc())
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.chdir(previous)
    return {"code": code, "stdout": out.read_text(errors="replace"), "stderr": err.read_text(errors="replace")}


def run_script_in_pool(pool: Any, path: Path, argv: Sequence[str], cwd: Path) -> Launch:
    """``python <path> <argv>`` with its ranks in ``pool`` (:func:`script_main`); the output is each rank's in
    turn, rank 0's first; the exit code the first non-zero one."""
    ranks = pool.run("tests.in_pool:script_main", path=str(path), argv=list(argv), cwd=str(cwd))
    code = next((r["code"] for r in ranks if r["code"]), 0)
    return Launch(("python", str(path), *argv), cwd, code, "".join(r["stdout"] for r in ranks),
                  "".join(r["stderr"] for r in ranks))


@contextlib.contextmanager
def no_rank_launch() -> Iterator[None]:
    """While active, a Trainer that would start its other ranks (Lightning's subprocess launcher re-runs
    ``sys.argv``: here, pytest's command line) raises instead: such a script runs in the pool."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    saved = _SubprocessScriptLauncher._call_children_scripts

    def refuse(self: Any) -> None:
        if self.num_processes * self.num_nodes > 1:
            raise RuntimeError("this script starts ranks of its own: run it in the pool (tests/launches.py "
                               "run_script_in_pool), not in the test process")
        saved(self)

    _SubprocessScriptLauncher._call_children_scripts = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        _SubprocessScriptLauncher._call_children_scripts = saved  # type: ignore[method-assign]


def run_script_in_process(path: Path, argv: Sequence[str], cwd: Path) -> Launch:
    """``python <path> <argv>`` in this process (a script of one process), in ``cwd``; a script that would start
    ranks fails (:func:`no_rank_launch`)."""
    import runpy

    out, err = io.StringIO(), io.StringIO()
    code, saved_argv, saved_path, previous = 0, sys.argv, list(sys.path), os.getcwd()
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), fresh_warnings(), no_rank_launch():
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(previous)
    return Launch(("python", str(path), *argv), cwd, code, out.getvalue(), err.getvalue())
