"""ZeRO applied to a module (:func:`apply_zero`): the engine over what this rank holds after every other parallelism,
coupled to the ranks that hold the rest of the model (:func:`model_parallel_coupling`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from typing import Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.tree import Settings
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.engine_setup import StageCoupling
from lightning_zero.core.zero.engine_step import weighted_norm_excess
from lightning_zero.parallel.mesh import StrategyMesh
from lightning_zero.parallel.pipeline import StrategyPipeline
from lightning_zero.parallel.tensor import StrategyTensorParallel


class PrecisionPlugin(Protocol):
    """What the composition asks of the strategy's precision plugin (``lightning/precision.py``'s
    ``ZeroPrecision``, a layer above): the module cast to the training dtypes and back, the weights from before the
    cast (the fp32 masters start from them), the engine's dtypes, and the engine it steps through."""

    def convert_module(self, module: nn.Module) -> nn.Module: ...

    def restore_module(self, module: nn.Module) -> None: ...

    def dtype_policy(self, module: nn.Module | None = None) -> DtypePolicy: ...

    def master_init(self) -> dict[nn.Parameter, torch.Tensor]: ...

    def replace_originals(self, remap: Callable[[dict[nn.Parameter, torch.Tensor]],
                                                dict[nn.Parameter, torch.Tensor]]) -> None: ...

    def release_originals(self, params: set[nn.Parameter]) -> None: ...

    def bind_engine(self, engine: ZeroEngine | None) -> None: ...


def apply_zero(module: nn.Module, optimizer: Optimizer | None, mesh: StrategyMesh, settings: Settings,
               precision: PrecisionPlugin, param_init_fn: ParamInitFn | None, agreed: Mapping[str, str],
               pipeline: StrategyPipeline | None, tensor: StrategyTensorParallel | None,
               experts: Set[nn.Parameter] = frozenset()) -> ZeroEngine:
    """The ZeRO engine of ``settings`` over ``module`` (this rank's pipeline stage when pipelined) and
    ``optimizer`` (``None``: evaluating a model that exists only as shards), partitioned over ZeRO's group of the
    mesh (``zero_axes``) and coupled to the pipeline stages and tensor-parallel ranks (``agreed``: the settings
    compared across ranks with the model's structure); ``experts`` (expert parallelism's parameters) are
    partitioned over the experts' ZeRO group instead (``mesh.comm.expert_data``)."""
    coupling = model_parallel_coupling(mesh, pipeline, tensor)  # its collectives the mesh's, made once
    return ZeroEngine(
        pipeline.local.module if pipeline is not None else module, optimizer, settings.zero, mesh.comm,
        dtypes=precision.dtype_policy(module),
        master_init=precision.master_init() if optimizer is not None else None,
        param_init_fn=param_init_fn, init_seed=torch.initial_seed() % 2**63, setup_settings=agreed,
        offload=settings.offload,
        coupling=coupling, experts=experts,
    )


def model_parallel_coupling(mesh: StrategyMesh, pipeline: StrategyPipeline | None,
                            tensor: StrategyTensorParallel | None) -> StageCoupling | None:
    """The engine's one :class:`StageCoupling`: the gradient norm and the fp16 overflow flag are combined over
    the ranks holding the rest of the model (``mesh.model_parallel``, made with the mesh: the pipeline and tensor
    axes that are on; one all-reduce after the data group's; Note [rank order]); each rank leaves out the share of
    a parameter that another holder counts too, the largest of the pipeline's (a tie another stage owns: all) and
    tensor parallel's (a replicated parameter: ``1 - 1/tp``) (Note [counting a parameter once])."""
    weights = [w for w in (pipeline.norm_weight if pipeline is not None else None,
                           tensor.norm_weight if tensor is not None else None) if w is not None]
    if not weights:
        return None
    return StageCoupling(mesh.model_parallel, weighted_norm_excess(lambda p: max(w(p) for w in weights)))
