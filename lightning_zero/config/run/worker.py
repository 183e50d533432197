"""One rank of a run: ``python -m lightning_zero.config.run.worker <run_dir>/config.yaml``.

Started by :func:`lightning_zero.config.run.launch.launch_ranks` under ``torch.distributed.run`` (which
sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, so Lightning joins that
group instead of re-launching ``sys.argv``). It never touches Hydra: the composed, resolved config
is read from the YAML file, and everything is written next to it. It also works under any other
``torchrun`` / ``srun`` launch of the same command, e.g. on several nodes.

Note [rank exit]
    A rank that finished its fit leaves through :func:`exit_after_handlers`: the threads that are not
    daemons are joined (as at any exit), the ``atexit`` handlers run (``close_all``, Note [clean
    exit], which destroys the process groups; ``logging``'s flush, every library's own), stdout and stderr are
    flushed, then ``os._exit``. What is skipped is the interpreter's finalization: tearing down ~3,000
    modules of torch and Lightning and ~400,000 objects, about 2 s of CPU per rank (measured: 2.2 s
    between the last ``atexit`` handler and the process's exit, half the teardown of a 2-rank launch),
    which writes nothing: the Trainer closed its loggers and every file the run writes is closed when
    ``fit`` returns. A rank that raises leaves the usual way (``@record`` writes torchrun's error
    file, the traceback is printed). ``python -m lightning_zero`` (the launching process) ends the
    same way: 1-1.5 s per command.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from lightning_zero.config.paths import COMMAND_NAMES, FIT
from lightning_zero.config.schema import to_train_config
from lightning_zero.config.validate import validate_config
from lightning_zero.core.comm.process_groups import close_all
from lightning_zero.core.common.errors import USAGE_EXIT, UsageError


@record  # torchrun's failure summary then shows this rank's traceback
def main(argv: Sequence[str] | None = None) -> int:
    """Run the rank; the run directory is the config file's folder. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2) or (len(args) == 2 and args[1] not in COMMAND_NAMES):
        print("usage: python -m lightning_zero.config.run.worker <run_dir>/config.yaml [validate|test|predict]",
              file=sys.stderr)
        return 2
    try:
        return run_rank(Path(args[0]), args[1] if args[1:] else FIT)
    finally:
        # the process groups (the strategy's too) die now, not during interpreter finalization:
        # Note [clean exit] in lightning_zero/core/comm/process_groups.py
        close_all()


def run_rank(config_file: Path, command: str = FIT) -> int:
    """One rank's ``command`` on ``config_file`` (the run directory is its folder), the process groups left open
    (:func:`main` closes them; the test suite's warm pool runs this and keeps its own). Returns the exit code.

    Args:
        config_file: the run's ``config.yaml``, written by the launcher.
        command: ``fit`` or one of validate / test / predict (a checkpoint in the config's ``ckpt_path``).
    """
    path = config_file.resolve()
    cfg = validate_config(to_train_config(OmegaConf.to_container(OmegaConf.load(path))))  # type: ignore[arg-type]
    # Lightning after the config's checks (a rank with a bad config fails in ~1 s, not after ~5 s of imports), and
    # here, not for ``python -m lightning_zero``'s exit
    from lightning_zero.config.run.build import evaluate, fit

    try:
        if command != FIT:
            evaluate(cfg, path.parent, command)
        else:
            fit(cfg, path.parent)
    except UsageError as err:  # what the user asked for, seen only here (a `_target_`, a checkpoint's keys)
        if os.environ.get("RANK", "0") == "0":  # every rank finds the same: said once
            print(f"lightning-zero: error: {err}", file=sys.stderr, flush=True)
        return USAGE_EXIT
    return 0


THREAD_JOIN_S = 10.0  # how long a finished rank waits for its other non-daemon threads, all of them together


def exit_after_handlers(code: int) -> NoReturn:
    """Join the non-daemon threads (at most ``THREAD_JOIN_S`` in all: a 2-rank run with sparse attention left one
    that never ends, and the rank hung at exit), run the ``atexit`` handlers, flush stdout and stderr, and end the
    process with ``code`` without the interpreter's finalization (Note [rank exit])."""
    deadline = time.monotonic() + THREAD_JOIN_S  # a thread that never ends (a compile worker pool) must not hang exit
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing left to flush to
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_after_handlers(main())
