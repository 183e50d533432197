"""The names ``Trainer(strategy=...)`` accepts for ``ZeroStrategy``: ``zero_stage_<s>``, their spawn forms and
the offload shortcuts.

Nothing here imports Lightning: ``import lightning_zero`` registers the names through this table once Lightning is
imported (``lightning_zero/__init__.py``), without importing the strategy.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.fabric.strategies import _StrategyRegistry
    from lightning.pytorch.strategies import Strategy


def register_zero_strategies(cls: Callable[..., Strategy], strategy_registry: _StrategyRegistry) -> None:
    """Register ``cls`` (``ZeroStrategy``, a subclass, or a function that builds one from the same keyword
    arguments) under every name of the table."""
    for stage in (0, 1, 2, 3):
        for suffix, method in (("", "popen"), ("_spawn", "spawn")):
            strategy_registry.register(
                f"zero_stage_{stage}{suffix}",
                cls,
                description=f"ZeRO stage {stage} (lightning_zero), start_method={method!r}",
                stage=stage,
                start_method=method,
            )
    for name, stage, kwargs in (
        ("zero_stage_2_offload", 2, {"offload_optimizer": "cpu"}),
        ("zero_stage_3_offload", 3, {"offload_optimizer": "cpu", "offload_param": "cpu"}),
        # the system's temporary space: the engine checks its free room and swaps in a run-private
        # directory below it, removed at exit (docs/offload.md); pass nvme_path= for a local NVMe drive
        (
            "zero_stage_3_offload_nvme",
            3,
            {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": tempfile.gettempdir()},
        ),
    ):
        strategy_registry.register(
            name, cls, description=f"ZeRO stage {stage} with {kwargs} (lightning_zero)", stage=stage, **kwargs
        )
