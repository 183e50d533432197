"""The attributes :class:`~lightning_zero.core.zero.engine.ZeroEngine` sets up, declared once for its mixins.

``engine_step.py`` and ``engine_views.py`` hold parts of the engine's methods; they read these
attributes, which ``ZeroEngine.__init__`` assigns (annotations only: nothing is stored here).
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.sharded_unit import ShardedUnit
from lightning_zero.core.zero.config import DtypePolicy, ZeroConfig
from lightning_zero.core.zero.flat_param import FlatParamGroup
from lightning_zero.core.zero.grad_reducer import GradReducer
from lightning_zero.core.zero.optimizer import ShardedOptimizer


class EngineFields:
    """What every part of :class:`~lightning_zero.core.zero.engine.ZeroEngine` may read."""

    module: nn.Module
    optimizer: Optimizer | None
    config: ZeroConfig
    comm: DataParallelComm
    dtypes: DtypePolicy
    names: dict[nn.Parameter, str]
    groups: list[FlatParamGroup]
    all_groups: list[FlatParamGroup]
    units: list[ShardedUnit]
    runtime: Stage3Runtime | None
    reducer: GradReducer
    sharded: ShardedOptimizer | None
