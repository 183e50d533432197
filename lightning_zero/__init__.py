"""lightning_zero: DeepSpeed-style ZeRO for PyTorch Lightning, built on torch.distributed."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoint import CheckpointError, consolidate_checkpoint, convert_checkpoint
from lightning_zero.core.comm.onebit_adam import OneBitAdam
from lightning_zero.core.offload.config import OffloadConfig, OffloadDevice
from lightning_zero.core.precision.loss_scaler import LossScaler, LossScalerConfig
from lightning_zero.core.stage3.gathered import gathered_parameters
from lightning_zero.core.zero.config import DtypePolicy, NonFinitePolicy, ZeroConfig, ZeroStage
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.memory import ModelStateBytes, model_state_formula
from lightning_zero.deepspeed.strategy import DeepSpeedZeroStrategy
from lightning_zero.estimator import MemoryEstimate, estimate_memory
from lightning_zero.estimator.advisor import Advice, advise
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.lightning.strategy import ZeroStrategy
from lightning_zero.observability.callbacks import ZeroStatsMonitor
from lightning_zero.observability.dashboard import ZeroTensorBoardLogger
from lightning_zero.observability.monitoring import ProfilerWindow
from lightning_zero.pipeline import PipelineConfig
from lightning_zero.reliability.hang_watchdog import long_phase
from lightning_zero.tensor_parallel import TensorParallelConfig

if "zero_stage_0" not in StrategyRegistry:
    ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "Advice",
    "CheckpointError",
    "DeepSpeedZeroStrategy",
    "DtypePolicy",
    "LossScaler",
    "LossScalerConfig",
    "MemoryEstimate",
    "ModelStateBytes",
    "NonFinitePolicy",
    "OffloadConfig",
    "OffloadDevice",
    "OneBitAdam",
    "PipelineConfig",
    "ProfilerWindow",
    "TensorParallelConfig",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroPrecision",
    "ZeroStage",
    "ZeroStatsMonitor",
    "ZeroStrategy",
    "ZeroTensorBoardLogger",
    "advise",
    "consolidate_checkpoint",
    "convert_checkpoint",
    "estimate_memory",
    "gathered_parameters",
    "long_phase",
    "model_state_formula",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """Former names, with a warning that says the new one."""
    if name == "DynamicLossScaler":
        from lightning_zero.core.precision import loss_scaler

        return loss_scaler.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
