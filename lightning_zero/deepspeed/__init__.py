"""DeepSpeed JSON configs for lightning_zero: parsing, optimizers, LR schedulers and the strategy glue.

* :mod:`~lightning_zero.deepspeed.config` -- :func:`parse_deepspeed_config` -> :class:`DeepSpeedConfig`.
* :mod:`~lightning_zero.deepspeed.batch` -- the batch-size triple, resolved against the world size.
* :mod:`~lightning_zero.deepspeed.optim` -- the ``optimizer`` section as a ``torch.optim`` optimizer.
* :mod:`~lightning_zero.deepspeed.schedulers` -- DeepSpeed's LR schedules as PyTorch LR schedulers.
* :mod:`~lightning_zero.deepspeed.strategy` -- ``DeepSpeedZeroStrategy.from_deepspeed_config`` and its precedence rules.

Only the strategy glue imports Lightning; nothing here imports Hydra.
"""

from lightning_zero.deepspeed.batch import BatchSizes, ResolvedBatch
from lightning_zero.deepspeed.config import DeepSpeedConfig, SectionSpec, parse_deepspeed_config
from lightning_zero.deepspeed.optim import OptimizerRecipe, optimizer_recipe
from lightning_zero.deepspeed.schedulers import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "SCHEDULERS",
    "BatchSizes",
    "DeepSpeedConfig",
    "LRRangeTest",
    "OneCycle",
    "OptimizerRecipe",
    "ResolvedBatch",
    "SectionSpec",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
    "optimizer_recipe",
    "parse_deepspeed_config",
]
