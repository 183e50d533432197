"""lightning_zero: DeepSpeed-style ZeRO for PyTorch Lightning, built on torch.distributed.

Every public name is imported when first used (Note [lazy package names] in ``core/lazy.py``): ``import
lightning_zero`` alone imports neither Lightning nor the engine, so the ``lightning-zero`` launcher stays light.
The ``Trainer(strategy=...)`` names (``zero_stage_0`` .. ``zero_stage_3``, their ``_spawn`` forms, the offload
shortcuts) are registered with Lightning as soon as both are imported, in either order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_zero.compat import install as _serve_former_paths
from lightning_zero.core.lazy import after_import, lazy_exports

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "lightning_zero.checkpoint": ("CheckpointError", "consolidate_checkpoint", "convert_checkpoint"),
        "lightning_zero.core.comm.onebit_adam": ("OneBitAdam",),
        "lightning_zero.core.common.choices": ("NonFinitePolicy", "OffloadDevice", "ZeroStage"),
        "lightning_zero.core.comm.data_parallel": ("DataParallelComm",),
        "lightning_zero.core.common.memory": ("ModelStateBytes", "model_state_formula"),
        "lightning_zero.core.precision.loss_scaler": ("LossScaler",),
        "lightning_zero.core.stage3.gathered": ("gathered_parameters",),
        "lightning_zero.core.settings.offload": ("OffloadConfig",),
        "lightning_zero.core.settings.precision": ("DtypePolicy", "LossScalerConfig", "PrecisionConfig"),
        "lightning_zero.core.settings.tree": ("Settings",),
        "lightning_zero.core.settings.zero": ("ZeroConfig",),
        "lightning_zero.core.zero.engine": ("ZeroEngine",),
        "lightning_zero.deepspeed.strategy": ("DeepSpeedZeroStrategy",),
        "lightning_zero.estimator": ("MemoryEstimate", "estimate_memory"),
        "lightning_zero.estimator.advisor": ("Advice", "advise"),
        "lightning_zero.lightning.precision": ("ZeroPrecision",),
        "lightning_zero.lightning.strategy": ("ZeroStrategy",),
        "lightning_zero.moe": ("ExpertParallelConfig", "MoE"),
        "lightning_zero.observability.callbacks": ("ZeroStatsMonitor",),
        "lightning_zero.observability.dashboard": ("ZeroTensorBoardLogger",),
        "lightning_zero.observability.monitoring": ("ProfilerWindow",),
        "lightning_zero.pipeline": ("PipelineConfig",),
        "lightning_zero.reliability.hang_watchdog": ("long_phase",),
        "lightning_zero.tensor_parallel": ("TensorParallelConfig",),
    },
    eager=("zero_strategy",),
)
__version__ = "0.1.0"
_serve_former_paths()  # every former path of the package, from lightning_zero/compat (Note [former paths])


def zero_strategy(**kwargs: Any) -> Strategy:
    """``ZeroStrategy(**kwargs)``: what the registered names build (the strategy is imported when a Trainer
    first asks for one, not when the names are registered)."""
    from lightning_zero.lightning.strategy import ZeroStrategy

    return ZeroStrategy(**kwargs)


def _register_strategy_names() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero.lightning.registry import register_zero_strategies

    if "zero_stage_0" not in StrategyRegistry:
        register_zero_strategies(zero_strategy, StrategyRegistry)


after_import("lightning.pytorch", _register_strategy_names)
