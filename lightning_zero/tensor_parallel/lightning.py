"""The strategy's side of tensor parallelism: the mesh's groups, applying the plan, the engine's norm over
tensor x data, and the combinations refused (the sampler over data only is the strategy's, from the mesh).

Note [TP composition order]
    Inside ``ZeroStrategy.setup``: the plan is applied first (before the precision plugin casts the
    module, so the fp32 masters start from the sliced weights; the pipeline split would come before it
    once pipeline x TP is built), then ZeRO flattens what the rank holds: its TP slices and the
    replicated parameters. TP changes parameter shapes, so it must run before anything records them.
    ZeRO partitions over the data axis only (``ParallelDims.zero_axes``): the TP ranks of one data
    replica hold different tensors, never shards of the same buffer.

Note [norm over tensor x data]
    Each rank's squared gradient norm is over its data shard of its TP slices and of the replicated
    parameters. Summed over data, then over the TP group, a split parameter counts once (its slices
    are disjoint) and a replicated one ``tp`` times (every TP rank holds the same gradient, Note
    [conjugate functions]): ``replicated_norm_excess`` subtracts ``(1 - 1/tp)`` of each replicated
    element's term before the sums. The fp16 overflow flag is agreed over data, then over TP: all ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.onebit_adam import OneBitAdam
from lightning_zero.core.mesh.dims import Axis
from lightning_zero.core.mesh.groups import ProcessMesh
from lightning_zero.core.zero.engine import StageCoupling
from lightning_zero.core.zero.flat_param import FlatParamGroup, overlap
from lightning_zero.tensor_parallel.checkpoint import TensorParallelCheckpoint
from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.config import TensorParallelConfig
from lightning_zero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, split_dim
from lightning_zero.tensor_parallel.plan import apply_plan, check_heads, find_plan, resolve_plan
from lightning_zero.tensor_parallel.vocab import VocabParallelEmbedding

TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def refuse_combinations(tp: TensorParallelConfig, *, pipeline: bool, offload: bool) -> None:
    """The compositions not built in this slice, refused at construction with the reason. Offload composes: TP
    only changes what the rank's flat buffers hold, and the engine offloads their shards as any others."""
    del offload  # composes (tests/distributed/test_tensor_parallel.py: parity with offload against the unsplit model)
    if not tp.enabled:
        return
    if pipeline:
        raise ValueError("tensor_parallel with a pipeline is not built yet (the pipeline's stage groups and the TP "
                         "groups are not composed on one mesh): use tensor_parallel or pipeline, not both")


def replicated_norm_excess(tp_size: int) -> Any:
    """The engine's ``norm_excess`` hook for TP (Note [norm over tensor x data])."""
    keep = 1.0 - 1.0 / tp_size

    def excess(grads: list[torch.Tensor], groups: list[FlatParamGroup], norm_type: float) -> float:
        if math.isinf(norm_type):
            return 0.0
        total = 0.0
        for g, t in zip(groups, grads):
            whole = t.numel() == g.padded_numel
            start, end = (0, g.padded_numel) if whole else g.shard_range()
            for s in g.slots:
                if split_dim(s.param) is not None:
                    continue
                lo, hi = overlap(s.offset, s.offset + s.numel, start, end)
                if hi > lo:
                    total += float(t[lo - start : hi - start].float().abs().pow(norm_type).sum())
        return keep * total

    return excess


class StrategyTensorParallel:
    """One strategy's tensor-parallel state: the mesh (created once), its two groups, the applied plan."""

    def __init__(self, config: TensorParallelConfig, mesh: ProcessMesh, collective: Any) -> None:
        self.config = config
        self.dims = mesh.dims
        self.tp = TPGroup(mesh.group(Axis.TENSOR), config.size, mesh.index(Axis.TENSOR))
        # the TP group's own comm: the engine combines norms and the overflow flag over it (a group of the
        # strategy's mesh, which closes it at exit)
        self.tp_comm = DataParallelComm(mesh.group(Axis.TENSOR), collective)
        self.split: list[str] = []
        self.checkpoint = TensorParallelCheckpoint(self.tp, mesh.dims, mesh.rank)  # unsplit states (checkpoint.py)
        self._module: nn.Module | None = None  # the module split (a later fit of the same run keeps it)

    def apply(self, module: nn.Module) -> None:
        """Refuse what cannot be split, then replace the planned modules by their slices (Note [slice after build]).
        The module this strategy split already (``validate`` then ``fit``) stays as it is."""
        if self.split and module is self._module:
            return
        if any(isinstance(m, TP_LAYERS) for m in module.modules()):
            raise ValueError(f"{type(module).__name__} is already split by tensor parallelism (a previous fit with "
                             "tensor_parallel): build a fresh module for another fit")
        if any(p.is_meta for p in module.parameters()):
            raise ValueError("tensor_parallel with a model built on the meta device (configure_model at ZeRO stage "
                             "3) is not built yet: build the model whole (Note [slice after build]), or drop "
                             "tensor_parallel")
        check_heads(module, self.config.size)
        plan, source = find_plan(module, self.config.plan)
        self.split = apply_plan(module, resolve_plan(module, plan, source), self.tp)
        self._module = module

    def splits(self, module: nn.Module) -> bool:
        """Whether ``module`` is the one this strategy split (its states are slices)."""
        return bool(self.split) and module is self._module

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse an optimizer that does not compose with TP yet (before the engine is built)."""
        if isinstance(optimizer, OneBitAdam):
            raise ValueError("tensor_parallel with 1-bit Adam is not built yet (after its warm-up each rank keeps its "
                             "own gradients and the momenta are averaged by the compressed all-reduce over the data "
                             "group: neither the clipping norm over tensor x data nor its checkpoints' per-rank "
                             "error-feedback residuals are composed with the TP slices): use AdamW / Adam / SGD, or "
                             "drop tensor_parallel")

    def coupling(self) -> StageCoupling:
        """The engine's norm and overflow agreement over tensor x data (Note [norm over tensor x data]), given
        to the engine's constructor."""
        return StageCoupling(model_parallel=self.tp_comm, norm_excess=replicated_norm_excess(self.config.size))


def refuse_pipeline_checkpoint(config: TensorParallelConfig, pipelined: bool, what: str) -> None:
    """Checkpoints with tensor parallelism are built (tensor_parallel/checkpoint.py), but not of a pipeline whose
    stages are split by TP: refused in every format, before anything is written or read."""
    if config.enabled and pipelined:
        raise NotImplementedError(
            f"{what} a checkpoint of pipeline x tensor_parallel={config.size} is not built yet (a stage's TP slices "
            "are not merged into the pipeline's checkpoint): train without checkpoints (enable_checkpointing=False; "
            "the CLI: trainer.checkpoint.enabled=false), or without the pipeline")
