"""``python -m lightning_zero <command> ...``: the same as the ``lightning-zero`` console script, ending without
the interpreter's teardown (Note [rank exit] in lightning_zero/config/worker.py) when it is the process's main
program; run inside another program (``runpy.run_module(..., run_name="__main__")``, a test) it raises
``SystemExit`` like any command line, and never ends its host process."""

import sys

from lightning_zero.cli import main
from lightning_zero.config.run.worker import exit_after_handlers

if __name__ == "__main__":
    code = main()
    if getattr(sys.modules.get("__main__"), "__dict__", None) is globals():  # python -m lightning_zero
        exit_after_handlers(code)
    raise SystemExit(code)
