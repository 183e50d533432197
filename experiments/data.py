"""Moved to :mod:`lightning_zero.models.data` (the CLI and the estimator build it); this name keeps working."""

from lightning_zero.models.data import *  # noqa: F403
