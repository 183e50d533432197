"""Moved to :mod:`lightning_zero.models.mlp` (the CLI and the estimator build it); this name keeps working."""

from lightning_zero.models.mlp import *  # noqa: F403
