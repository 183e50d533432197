"""A pool of gloo worker processes, kept alive across tasks, that runs one function on every rank.

Each worker joins one gloo process group (FileStore) and imports Lightning once, so a task pays for its body
only, not ~8 s of process start-up. ``GlooPool.run("pkg.mod:fn", **kw)`` calls ``fn(**kw)`` on every rank
and returns the results by rank. A task that times out, kills a worker, or fails on some ranks while others
hang poisons the pool: it is killed and started afresh by the next ``run``. The test suite runs its
distributed test bodies in one pool per session (``tests/conftest.py``), the benchmarks their contenders
(``benchmarks/harness``; ``python=`` runs the workers under another interpreter, e.g. a virtual environment
with DeepSpeed that the project's own does not have); Lightning finds the group initialised and the rank
variables set, so it neither spawns processes nor re-initialises the group.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parents[2])  # so that tasks in tests/ and benchmarks/ import
_TAIL_LINES = 40
Reply = tuple[bool, Any]  # (True, result) or (False, traceback text)


class GlooPoolError(RuntimeError):
    """A pool task raised, timed out or killed a worker; the message carries the remote details."""


def _tail(path: Path, start: int = 0) -> str:
    """The last lines of ``path`` written after byte offset ``start``."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        lines = []
    return "\n".join(lines[-_TAIL_LINES:]) or "<no output>"


# ------------------------------------------------------------------------------------------------ worker side
def _init_group(rank: int, world_size: int, store: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)


def _resolve(target: str) -> Callable[..., Any]:
    """``"pkg.mod:fn"`` -> ``fn``; modules are imported with pytest's assertion rewriting when possible."""
    name, sep, fn_name = target.partition(":")
    if not sep:
        raise ValueError(f"a task target looks like 'package.module:function', not {target!r}")
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        try:
            from _pytest.assertion.rewrite import rewrite_asserts
        except ImportError:
            spec = None
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            importlib.import_module(name)
        else:
            source = Path(spec.origin).read_bytes()
            tree = ast.parse(source, filename=spec.origin)
            rewrite_asserts(tree, source, spec.origin)
            sys.modules[name] = module = importlib.util.module_from_spec(spec)
            try:
                exec(compile(tree, spec.origin, "exec", dont_inherit=True), module.__dict__)
            except BaseException:
                del sys.modules[name]
                raise
    return getattr(sys.modules[name], fn_name)


def _release_task_groups() -> None:
    """Destroy every process group a task left behind; the pool's default group stays.

    Note [groups left by tasks]
        A strategy's groups live until the process exits (Note [clean exit] in
        core/comm/process_groups.py), and torch's registry keeps any ``new_group`` group alive until it
        is destroyed. A worker serves hundreds of tasks: it held 288 groups after a third of the suite,
        whose 864 idle gloo threads (a ``gloo_tcp_loop`` and two ``pt_gloo_runloop`` each) took 1.2 cores
        per worker on a 2-core machine, slowing every later test and every later benchmark contender.
        Every rank runs this after every task, so every rank destroys the same groups. A pool running
        DeepSpeed keeps them (``release_groups=False``): DeepSpeed caches its groups across engines.
    """
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from lightning_zero.core.comm import process_groups

    process_groups.close_owned()
    if dist.is_available() and dist.is_initialized():
        world = distributed_c10d.GroupMember.WORLD
        for group in [g for g in list(distributed_c10d._world.pg_map) if g is not world]:
            with contextlib.suppress(ValueError, RuntimeError):  # destroyed meanwhile
                dist.destroy_process_group(group)
    gc.collect()  # the last references sit in Lightning's reference cycles: their C++ groups end here


def _worker_main(rank: int, world_size: int, env: dict[str, str], gen_dir: str, conn: Connection,
                 threads: int = 1, sys_path: list[str] | None = None, release_groups: bool = True,
                 warm: bool = True, environ: dict[str, str] | None = None) -> None:
    """Join the gloo group, then run ``(task_id, target, kwargs)`` messages until ``None`` or EOF.

    ``sys_path``: the interpreter's own import path, put first (spawn hands the child the parent's path).
    ``warm``: import Lightning and every public name of lightning_zero before the first task."""
    if sys_path:
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
    log = open(Path(gen_dir) / f"rank{rank}.log", "ab", buffering=0)  # noqa: SIM115 - lives as long as we do
    os.dup2(log.fileno(), 1)  # away from whatever pytest was capturing when we were spawned
    os.dup2(log.fileno(), 2)
    for stream in (sys.stdout, sys.stderr):
        getattr(stream, "reconfigure", lambda **_: None)(line_buffering=True)
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    if environ is not None:  # the caller's environment as it was meant, not as its threads had it at the spawn
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(env)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    _init_group(rank, world_size, Path(gen_dir) / "store0")
    from lightning_utilities.core.rank_zero import rank_zero_only  # the object Lightning's modules re-export

    if warm:  # imported already in a worker forked from the warm fork server (Note [warm workers])
        from lightning_zero.testing.warm import import_all

        import_all()

    base_env = dict(os.environ)
    conn.send_bytes(pickle.dumps((True, "ready")))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the pytest process went away
            break
        if message is None:
            break
        task_id, target, kwargs = message
        print(f"===== task {task_id}: {target} =====", flush=True)
        os.environ.clear()  # LightningEnvironment.teardown() deletes WORLD_SIZE; bodies may set more
        os.environ.update(base_env)
        rank_zero_only.rank = rank
        torch.set_num_threads(threads)
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the pytest process, which kills us
        if not dist.is_initialized():  # a body destroyed the group: every rank rejoins on a fresh store
            _init_group(rank, world_size, Path(gen_dir) / f"store{task_id}")
        os.chdir(Path(gen_dir) / f"task{task_id}")
        try:
            reply = pickle.dumps((True, _resolve(target)(**kwargs)))
        except BaseException:
            reply = pickle.dumps((False, traceback.format_exc()))
        os.chdir(gen_dir)
        if release_groups:
            _release_task_groups()
        conn.send_bytes(reply)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips ~1-2 s of torch/Lightning interpreter teardown


# ------------------------------------------------------------------------------------------------ caller side
class GlooPool:
    """``world_size`` gloo workers that run functions named ``"package.module:function"``, forked from a warm fork
    server (Note [warm workers]) or spawned under another interpreter.

    Args:
        world_size: number of ranks (processes).
        timeout_s: default per-task limit; past it the pool is killed and restarted by the next ``run``.
        grace_s: once a rank has raised, how long the others may take to answer before they are presumed
            stuck in a collective and the pool is restarted.
        threads: torch threads per rank (and ``OMP_NUM_THREADS``), set again before every task.
        python: the interpreter the workers run under (default: this one), e.g. another virtual environment's
            ``bin/python`` with the same Python version; its import path comes first in the workers.
        env: extra environment variables of the workers (e.g. ``{"DS_ACCELERATOR": "cpu"}``).
        environ: the workers' whole environment under ``env`` (default: this process's at the start). A pool
            started from a background thread passes the environment its tests start from: a test running
            meanwhile in the main thread may have set variables for itself alone.
        release_groups: destroy the process groups a task left after every task (Note [groups left by
            tasks]). ``False`` for a library that keeps its groups in module globals across tasks and
            reuses them (DeepSpeed's ``deepspeed.utils.groups``): destroyed, its next engine fails.
        warm: import Lightning and lightning_zero's public names at start (done once by the fork server, else
            ~5 s of CPU per rank), so that no task pays for them; ``False`` for a pool whose tasks need torch only
            (the pool's own tests).
        start: start the workers now; ``False``: at :meth:`start`, or the first :meth:`run` (which waits for a
            start another thread is making).
    """

    def __init__(self, world_size: int = 2, timeout_s: float = 300.0, grace_s: float = 5.0,
                 threads: int = 1, python: str | None = None, env: dict[str, str] | None = None,
                 release_groups: bool = True, warm: bool = True, start: bool = True,
                 environ: Mapping[str, str] | None = None) -> None:
        self.world_size, self.timeout_s, self.grace_s, self.threads = world_size, timeout_s, grace_s, threads
        self.release_groups, self.warm = release_groups, warm
        self.python, self.env = python, dict(env or {})
        self.environ = dict(environ) if environ is not None else None
        self._sys_path = _interpreter_path(python) if python else None
        self._root = Path(tempfile.mkdtemp(prefix="gloo_pool_"))
        self._gen_dir = self._root
        self._generation = self._task_id = 0
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._starting = threading.Lock()  # one start at a time: a start in another thread is waited for
        atexit.register(self.close)
        if start:
            self.start()

    @property
    def log_paths(self) -> list[Path]:
        """Each rank's stdout+stderr file for the current (or last killed) set of workers."""
        return [self._gen_dir / f"rank{rank}.log" for rank in range(self.world_size)]

    def start(self) -> None:
        """Start the workers unless they are running; block until every rank has joined the group."""
        with self._starting:
            self._start()

    def _start(self) -> None:
        if self._procs:
            return
        self._generation += 1
        self._gen_dir = self._root / f"gen{self._generation}"
        self._gen_dir.mkdir(parents=True)  # parents: a closed pool may be used again
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        ctx = _context(self.python)
        environ = self.environ if self.environ is not None else dict(os.environ)  # a fork server's is older
        for rank in range(self.world_size):
            # OMP_NUM_THREADS: Lightning's launcher would otherwise reset torch's thread count
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(self.world_size),
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
                   "OMP_NUM_THREADS": str(self.threads), **self.env}  # fmt: skip
            parent_conn, child_conn = ctx.Pipe()
            args = (rank, self.world_size, env, str(self._gen_dir), child_conn, self.threads, self._sys_path,
                    self.release_groups, self.warm, environ)
            proc = ctx.Process(target=_worker_main, args=args, name=f"gloo-pool-rank{rank}")
            _start_under(proc, self.python)
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._collect("pool start-up", self.timeout_s, [0] * self.world_size)

    def run(self, target: str, /, _timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``target`` (``"package.module:function"``) with ``kwargs`` on every rank; return results by rank.

        Every rank runs in the same fresh temporary directory, removed afterwards.

        Raises:
            GlooPoolError: some rank raised (the message holds each failing rank's traceback and output), or
                the task timed out or killed a worker (the pool is then restarted by the next call).
        """
        message = pickle.dumps((self._task_id + 1, target, kwargs))
        self.start()
        self._task_id += 1
        workdir = self._gen_dir / f"task{self._task_id}"
        workdir.mkdir()
        offsets = [path.stat().st_size if path.exists() else 0 for path in self.log_paths]
        try:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a dead worker: _collect reports it
                    conn.send_bytes(message)
            replies = self._collect(target, self.timeout_s if _timeout_s is None else _timeout_s, offsets)
        except BaseException:
            self._kill()  # timeouts, dead workers, Ctrl-C, pytest-timeout: never reuse a half-run pool
            raise
        shutil.rmtree(workdir, ignore_errors=True)
        failed = [rank for rank, (ok, _) in replies.items() if not ok]
        if failed:
            raise GlooPoolError(f"{target} failed on rank(s) {failed}:\n{self._details(failed, replies, offsets)}")
        return [replies[rank][1] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers politely (killing stragglers) and remove the pool's temporary files; a start another
        thread is making is waited for first."""
        with self._starting:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(None))
            for proc in self._procs:
                proc.join(timeout=10)
            self._kill()
            shutil.rmtree(self._root, ignore_errors=True)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def _details(self, ranks: list[int], replies: dict[int, Reply], offsets: list[int]) -> str:
        parts = []
        for rank in sorted(ranks):
            if rank in replies and not replies[rank][0]:
                parts.append(f"----- rank {rank} traceback -----\n{replies[rank][1].rstrip()}")
            output = _tail(self.log_paths[rank], offsets[rank])
            parts.append(f"----- rank {rank} output (last {_TAIL_LINES} lines) -----\n{output}")
        return "\n".join(parts)

    def _collect(self, label: str, timeout_s: float, offsets: list[int]) -> dict[int, Reply]:
        """One reply per rank; on a timeout, a dead worker, or a rank still busy ``grace_s`` after another
        one raised, kill the pool and raise."""
        replies: dict[int, Reply] = {}
        dead: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout_s
        while not dead and len(replies) < self.world_size and time.monotonic() < deadline:
            pending = [rank for rank in range(self.world_size) if rank not in replies]
            wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                 timeout=min(0.5, max(0.0, deadline - time.monotonic())))  # fmt: skip
            for rank in pending:
                try:
                    if self._conns[rank].poll():
                        replies[rank] = pickle.loads(self._conns[rank].recv_bytes())
                    elif not self._procs[rank].is_alive():
                        dead[rank] = self._procs[rank].exitcode
                except (EOFError, OSError):  # the worker closed its end: it died
                    self._procs[rank].join(timeout=5)
                    dead[rank] = self._procs[rank].exitcode
                except Exception:  # a result this process cannot unpickle
                    replies[rank] = (False, traceback.format_exc())
                if rank in replies and not replies[rank][0]:
                    deadline = min(deadline, time.monotonic() + self.grace_s)
        silent = [rank for rank in range(self.world_size) if rank not in replies and rank not in dead]
        if not dead and not silent:
            return replies
        self._kill()
        failed = [rank for rank, (ok, _) in replies.items() if not ok]
        if dead:
            why = "worker(s) died (" + ", ".join(f"rank {r}: exit code {c}" for r, c in dead.items()) + ")"
        elif failed:
            why = f"rank(s) {failed} raised and rank(s) {silent} did not answer within {self.grace_s:g} s after"
        else:
            why = f"rank(s) {silent} did not answer within {timeout_s:g} s"
        details = self._details([*dead, *silent, *failed], replies, offsets)
        raise GlooPoolError(f"{label}: {why}; the pool was killed and restarts on the next run.\n{details}")


def _interpreter_path(python: str) -> list[str]:
    """``sys.path`` of another interpreter (its site-packages), asked once."""
    try:
        done = subprocess.run([python, "-c", "import json, sys; print(json.dumps(sys.path))"], capture_output=True,
                              text=True, timeout=120, check=False)  # fmt: skip
    except OSError as e:
        raise GlooPoolError(f"cannot run the pool's interpreter {python!r}: {e}") from e
    if done.returncode != 0:
        raise GlooPoolError(f"cannot run the pool's interpreter {python!r}: {done.stderr.strip()[-500:]}")
    return [p for p in json.loads(done.stdout.strip().splitlines()[-1]) if p]


def start_fork_server() -> None:
    """Start the warm fork server now (Note [warm workers]): from this thread, with this process's environment
    as it is now; otherwise the first pool start starts it, in whatever thread and environment that start has."""
    from multiprocessing import forkserver

    _context(None)
    forkserver.ensure_running()


def _context(python: str | None) -> Any:
    """How the workers start: forked from the warm fork server, or spawned under another interpreter.

    Note [warm workers]
        A spawned worker imported torch, Lightning and lightning_zero itself: ~5 s of CPU per rank, paid again
        for every rank of every pool and every restart (the suite starts pools of 2, 3, 4 and 8 ranks). The
        workers are forked instead from multiprocessing's fork server, which imports
        :mod:`lightning_zero.testing.warm` once; a fork shares those pages. The server imports no more than
        modules (no torch operation, no thread), so each fork starts clean. A worker takes its environment from
        the pool (``environ``, default the caller's when the pool starts), not from the server, which started
        earlier. Another interpreter (``python=``) cannot be forked from this one: its workers are spawned.
    """
    if python is not None:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["lightning_zero.testing.warm"])  # no effect once the server runs
    return ctx


def _start_under(proc: BaseProcess, python: str | None) -> None:
    """Start a spawn process under ``python`` (multiprocessing's executable is global: set, then restored)."""
    if python is None:
        proc.start()
        return
    from multiprocessing import spawn

    previous = spawn.get_executable()
    spawn.set_executable(python)
    try:
        proc.start()
    finally:
        spawn.set_executable(previous)
