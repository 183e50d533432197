"""``python -m lightning_zero <command> ...``: the same as the ``lightning-zero`` console script, ending without
the interpreter's teardown (Note [rank exit] in lightning_zero/config/worker.py)."""

from lightning_zero.cli import main
from lightning_zero.config.worker import exit_after_handlers

if __name__ == "__main__":
    exit_after_handlers(main())
