"""Launches shared by the suite: ``lightning-zero`` commands run once per session, and the CLI's ranks in the pool.

Note [shared launches]
    A 2-rank ``lightning-zero train`` costs ~19 s of CPU (torchrun, two interpreters importing torch and
    Lightning) before its first step; a ``gpt_tiny`` fit itself takes ~1 s. So a test that reads what a run
    wrote (its console, ``config.yaml``, TensorBoard events, checkpoints, ``result.json``) asks for the run
    by its arguments and gets the one the session already made (fixture ``launches``):

    - ``launches.pool_cli(*args)``: the command through ``lightning_zero.cli.main`` in the test process, with the
      ranks' ``worker`` code run in the session's warm gloo pool of their world size instead of torchrun
      (:func:`launch_in_pool`). Everything from Hydra's composition to ``result.json`` and the TensorBoard
      events runs as in the real command, except torchrun and the ranks' processes (their start, their exit,
      the order in which the console gets their lines): a fit of ``gpt_tiny`` costs ~2 s. A one-device command
      (``trainer=cpu1``) trains in the test process, as the CLI does.
    - ``launches.cli(*args)``: a real ``lightning-zero`` (the console script) in a subprocess, for what only
      processes show: torchrun, the console through a pipe, exit codes, how the processes end
      (:data:`EXIT_PROBE`); ``launches.script(path, *args)``: ``python <path> <args>`` likewise.

    Each runs once per session for the same arguments, in a directory of its own holding links to the
    repository's files. A real launch that tests read is declared on them by its command,
    ``@pytest.mark.real_launch(("lightning-zero", *GPT_TINY))`` (or ``("python", script, *args)``): it then starts
    on the background lane when collection ends (Note [background lane] in tests/lane.py), and the first test
    that asks for it waits for that run instead of starting its own. Arguments are compared as written (``a b``
    and ``b a`` are two runs): use the argument tuples below, which are the docs' own commands (the docs test runs
    them through the same cache). A test that writes into a shared run (a resume into the same directory) copies
    it first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the launches the docs show (docs/configs.md) and several test files read; each runs once per session
GPT_TINY = ("train", "experiment=gpt_tiny")  # 2 ranks, ZeRO 2, 20 steps, a checkpoint, TensorBoard events
MULTIRUN = ("train", "-m", "experiment=gpt_tiny", "zero=stage1,stage2")  # two of it, one per stage
DETERMINISTIC = ("train", "experiment=gpt_tiny", "data.deterministic_order=true")  # every layout sees the same rows
ONE_RANK = ("train", "experiment=gpt_tiny", "trainer=cpu1", "data.deterministic_order=true")  # in the test process
TP2 = ("train", "experiment=gpt_tiny", "tensor_parallel=tp2", "trainer.devices=2", "data.deterministic_order=true")
SP2 = ("train", "experiment=gpt_tiny", "sequence_parallel=sp2", "trainer.devices=2", "data.deterministic_order=true")
# what a launcher sets for the ranks it starts (Lightning writes some into os.environ even for one rank)
LAUNCHER_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"}


# imported by every process of a real launch (PYTHONPATH); in a rank (RANK set) and in `python -m lightning_zero` /
# the console script it writes exit-<rank or cli> from its last atexit handler, finalized-<...> when the
# interpreter's finalization clears this module (torchrun's agent is left alone)
EXIT_PROBE = """
import atexit, os, sys
_cli = sys.orig_argv[1:3] == ["-m", "lightning_zero"] or [os.path.basename(a) for a in sys.orig_argv[1:2]] == [
    "lightning-zero"]
_who = os.environ.get("RANK") or ("cli" if _cli else None)
if _who and os.environ.get("EXIT_PROBE_DIR"):
    _where = os.path.join(os.environ["EXIT_PROBE_DIR"], "{}-" + _who)
    atexit.register(lambda: open(_where.format("exit"), "w").close())  # registered first: runs last

    class _Finalized:
        def __del__(self, _open=os.open, _close=os.close, _path=_where.format("finalized")):
            _close(_open(_path, os.O_CREAT | os.O_WRONLY))

    _finalized = _Finalized()
"""


@dataclass
class Launch:
    """One command's run: where it ran (``cwd``), its exit code and its output; ``exit_probe``: the folder where
    a real launch's processes left ``exit-<who>`` (their last exit handler ran) and ``finalized-<who>`` (the
    interpreter tore its modules down), ``who`` being a rank or ``cli``."""

    args: tuple[str, ...]
    cwd: Path
    returncode: int
    stdout: str
    stderr: str
    exit_probe: Path | None = None

    @property
    def output(self) -> str:
        """stdout then stderr."""
        return self.stdout + self.stderr

    def run_dirs(self) -> list[Path]:
        """The run directories (those holding a ``config.yaml``) under ``cwd``, sorted."""
        return sorted(p.parent for p in self.cwd.rglob("config.yaml") if p.parent.name != ".hydra")

    @property
    def run_dir(self) -> Path:
        """The only run directory (a ``-m`` multirun has several: :meth:`run_dirs`)."""
        runs = self.run_dirs()
        assert len(runs) == 1, (runs, self.output[-3000:])
        return runs[0]

    def check(self, code: int = 0) -> Launch:
        """Assert the exit code, showing the output's tail otherwise; returns self."""
        assert self.returncode == code, f"{' '.join(self.args)}: exit code {self.returncode}\n{self.output[-4000:]}"
        return self


ABNORMAL_EXIT = ("terminate called", "Signal 6", "SIGABRT", "exitcode  : -", "ChildFailedError", "core dumped")


def assert_clean_exit(output: str) -> None:
    """No sign of a rank that aborted at exit or failed (Note [clean exit] in core/comm/process_groups.py) in a
    launch's output: what the soak (tests/e2e/test_soak.py) requires of each of its launches."""
    for sign in ABNORMAL_EXIT:
        assert sign not in output, f"{sign!r} in the output:\n{output[-5000:]}"


def process_env(extra: dict[str, str] | None = None, exit_probe: Path | None = None) -> dict[str, str]:
    """The environment of a command that launches its own ranks: no launcher variables, this checkout first;
    with ``exit_probe``, every process of it reports its exit there (:data:`EXIT_PROBE`)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    path = [str(ROOT), os.environ.get("PYTHONPATH")]
    if exit_probe is not None:
        exit_probe.mkdir(parents=True, exist_ok=True)
        (exit_probe / "sitecustomize.py").write_text(EXIT_PROBE)
        path.insert(0, str(exit_probe))
        env["EXIT_PROBE_DIR"] = str(exit_probe)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    return {**env, **(extra or {})}


def console_script() -> list[str]:
    """The ``lightning-zero`` console script beside this interpreter (the docs' ``.venv/bin/lightning-zero``), else
    ``python -m lightning_zero``."""
    script = shutil.which("lightning-zero", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "lightning_zero"]


def run_process(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300,
                program: Sequence[str] | None = None, exit_probe: Path | None = None) -> Launch:
    """``lightning-zero <args>`` (or ``program + args``) in a subprocess, in ``cwd``."""
    cwd.mkdir(parents=True, exist_ok=True)
    command = [*(program or console_script()), *args]
    done = subprocess.run(command, cwd=cwd, env=process_env(env, exit_probe), capture_output=True, text=True,
                          timeout=timeout, check=False)
    return Launch(tuple(args), cwd, done.returncode, done.stdout, done.stderr, exit_probe)


class SharedLaunches:
    """The session's launches, each made once (Note [shared launches]); the fixture ``launches``.

    Each runs in a fresh directory holding links to the repository's files (``docs/examples/ds_config.json``
    resolves as in the checkout; the run's outputs land beside them, never in the checkout)."""

    def __init__(self, pools: Callable[[int], Any] | None = None) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="launches_"))
        self.pools = pools  # world size -> the session's pool of it, started only when a run asks for it
        self._runs: dict[tuple[Any, ...], Future[Launch]] = {}
        self._lock = threading.Lock()  # the lane's thread makes real launches too (:meth:`prestart`)

    def new_dir(self) -> Path:
        """A fresh empty directory of the session's."""
        return Path(tempfile.mkdtemp(dir=self._root))

    def _workdir(self) -> Path:
        from docs.regenerate import workdir

        return workdir(self.new_dir() / "cwd")

    def pool(self, world_size: int = 2) -> Any:
        """The session's pool of ``world_size`` ranks."""
        assert self.pools is not None, "the fixture `launches` binds the session's pools"
        return self.pools(world_size)

    def once(self, key: tuple[Any, ...], run: Any, cwd: Path | None = None) -> Launch:
        """``run(cwd)``'s launch, made once per session for ``key`` (in ``cwd`` when given, else in a fresh
        directory holding links to the repository's files); a caller that finds it running (on the lane) waits."""
        key = (*key, cwd)
        with self._lock:
            made = self._runs.get(key)
            if made is None:
                made = self._runs[key] = Future()
                made.set_running_or_notify_cancel()
                mine = True
            else:
                mine = False
        if mine:
            try:
                made.set_result(run(cwd or self._workdir()))
            except BaseException as error:
                made.set_exception(error)
        return made.result()

    def script(self, *args: str, cwd: Path | None = None) -> Launch:
        """``python <script> <args>`` (a path relative to the repository) in a subprocess, once per session."""
        return self.once(("script", *args), lambda where: run_process([str(ROOT / args[0]), *args[1:]], where,
                                                                      program=[sys.executable]), cwd)

    def prestart(self, command: Sequence[str], lane: Any) -> None:
        """Queue the real launch of ``command`` (``lightning-zero ...``: :meth:`cli`; ``python ...``: :meth:`script`)
        on the background lane (``@pytest.mark.real_launch``)."""
        program, *args = command
        assert program in ("lightning-zero", "python"), command
        launch = self.cli if program == "lightning-zero" else self.script
        lane.submit(f"real launch: {' '.join(command)}", lambda _: launch(*args))

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
            cwd: Path | None = None) -> Launch:
        """``lightning-zero <args>`` (the console script) in a subprocess, once per session for the same arguments
        and ``env``; its processes report their exits (:attr:`Launch.exit_probe`)."""
        return self.once(("process", args, tuple(sorted((env or {}).items()))),
                         lambda where: run_process(args, where, env, timeout, exit_probe=where.parent / "exit_probe"),
                         cwd)

    def pool_cli(self, *args: str, cwd: Path | None = None) -> Launch:
        """``lightning-zero <args>`` in this process with the ranks in the pool, once per session (in ``cwd``
        when given: then the run is that directory's, shared with no one)."""
        from tests.in_pool import run_in_process

        return self.once(("pool", args), lambda where: run_in_process(args, where, self.pool), cwd)

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
