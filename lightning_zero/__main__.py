"""``python -m lightning_zero <command> ...`` and the ``lightning-zero`` console script (:func:`console`): both end
without the interpreter's teardown (Note [rank exit] in lightning_zero/config/run/worker.py) when they are the process's
main program; run inside another program (``runpy.run_module(..., run_name="__main__")``, a test) ``python -m``
raises ``SystemExit`` like any command line, and never ends its host process."""

import sys
from typing import NoReturn

from lightning_zero.cli import main
from lightning_zero.config.run.worker import exit_after_handlers


def console() -> NoReturn:
    """The ``lightning-zero`` console script: :func:`~lightning_zero.cli.main`, then the exit after the handlers
    (~1 s of teardown less per command, as ``python -m lightning_zero``)."""
    exit_after_handlers(main())


if __name__ == "__main__":
    code = main()
    if getattr(sys.modules.get("__main__"), "__dict__", None) is globals():  # python -m lightning_zero
        exit_after_handlers(code)
    raise SystemExit(code)
