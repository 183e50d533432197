"""Moved to :mod:`lightning_zero.models.gpt` (the CLI and the estimator build it); this name keeps working."""

from lightning_zero.models.gpt import *  # noqa: F403
