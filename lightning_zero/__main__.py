"""``python -m lightning_zero <command> ...``: the same as the ``lightning-zero`` console script."""

import sys

from lightning_zero.cli import main

if __name__ == "__main__":
    sys.exit(main())
