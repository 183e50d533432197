"""Tensor parallelism applied to a module (:func:`apply`), and the strategy's side of it: the mesh's groups, the
plan, its share of the engine's norm over tensor x pipeline x data, and the combinations refused (the sampler over
data only is the mesh's).

Note [TP composition order]
    Inside ``ZeroStrategy.setup`` (``parallel/parallelize.py``): the precision plugin converts the module, the
    pipeline split picks the layers this rank's stage holds (materialising only those of a module built on
    the meta device), then the plan slices the planned layers: every TP rank of a stage builds the same
    whole layers and keeps its slices (Note [slice after build]); the other stages' layers, storage-less
    placeholders, are sliced into placeholders of the slices' shapes, so the pipeline reassembles the
    module at teardown with every rank's shapes agreeing. The pipeline then re-reads its layers (the
    plan replaced modules inside them) and the precision plugin its pre-cast weights (each sliced like
    its parameter, so the fp32 masters start from the exact slices). ZeRO comes last: it flattens what
    the rank holds, its TP slices and the replicated parameters. TP changes parameter shapes, so it runs
    before anything records them. ZeRO partitions over the data axis only (``ParallelDims.zero_axes``):
    the TP ranks of one data replica hold different tensors, never shards of the same buffer.

Note [norm over tensor x data]
    Each rank's squared gradient norm is over its data shard of its TP slices and of the replicated
    parameters. Summed over data, then over the TP group (with a pipeline: over pipeline x tensor, one
    group), a split parameter counts once (its slices are disjoint) and a replicated one ``tp`` times
    (every TP rank holds the same gradient, Note [conjugate functions]): :meth:`StrategyTensorParallel.norm_weight`
    leaves out ``(1 - 1/tp)`` of each replicated element's term before the sums (Note [counting a parameter
    once] in core/zero/engine_step.py). The fp16 overflow flag is agreed over data, then over the same
    model-parallel group: all ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightning_zero.checkpoint.slices import split_dim
from lightning_zero.core.comm.onebit_adam import OneBitAdam
from lightning_zero.core.mesh.dims import Axis
from lightning_zero.core.mesh.groups import ProcessMesh
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.tree import Settings
from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SliceMemo,
    VocabParallelEmbedding,
    has_storage,
    slice_local,
)
from lightning_zero.tensor_parallel.plan import apply_plan, check_heads, find_plan, resolve_plan
from lightning_zero.tensor_parallel.rng import agree_default_rng

TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


class StrategyTensorParallel:
    """One strategy's tensor-parallel state: the mesh (created once), its two groups, the applied plan."""

    def __init__(self, config: TensorParallelConfig, mesh: ProcessMesh) -> None:
        self.config = config
        self.mesh = mesh
        self.dims = mesh.dims
        self.tp = TPGroup(mesh.group(Axis.TENSOR), config.size, mesh.index(Axis.TENSOR))
        self.split: list[str] = []
        self.sliced: dict[nn.Parameter, nn.Parameter] = {}  # each whole parameter split -> this rank's slice
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
        memo: SliceMemo = {}
        self.split = apply_plan(module, resolve_plan(module, plan, source), self.tp, memo)
        self.sliced = {whole: part for whole, _, part in memo.values()}
        self._module = module

    def agree_replicated(self, module: nn.Module, originals: Mapping[nn.Parameter, torch.Tensor]) -> None:
        """Every TP rank of the group takes TP rank 0's replicated parameters and buffers, and the pre-cast weights
        of those parameters that the fp32 masters start from (``originals``), as DDP takes rank 0's: processes
        seeded differently (nobody called ``seed_everything``) would otherwise train different copies of one
        parameter. A split parameter's slices are each rank's own (built from its own seed: seed every rank
        alike for the unsplit model's weights, Note [slice after build]). Storage-less placeholders (another
        pipeline stage's layers) are left out; a collective over the TP group."""
        params = [p for p in module.parameters() if split_dim(p) is None and _holds_values(p)]
        buffers = [b for b in module.buffers() if _holds_values(b)]
        self.tp.broadcast_first([p.data for p in params] + buffers + [originals[p] for p in params if p in originals])

    def agree_rng(self, device: torch.device) -> None:
        """Every TP rank of the group takes TP rank 0's default generator states, so the replicated activations'
        dropout masks agree (Note [dropout streams] in rng.py); a collective over the TP group."""
        agree_default_rng(self.tp, device)

    def splits(self, module: nn.Module) -> bool:
        """Whether ``module`` is the one this strategy split (its states are slices)."""
        return bool(self.split) and module is self._module

    def slice_originals(self, originals: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """The precision plugin's pre-cast weights after :meth:`apply`: each split parameter's cut like it, keyed
        by its slice (the fp32 masters start from the exact slices: Note [TP composition order]); a slice
        without storage (another pipeline stage's placeholder) keeps none. Called once after :meth:`apply`; it
        then forgets the whole parameters, which the map kept alive (a whole layer per rank for the whole fit:
        tests/distributed/test_tensor_parallel_memory.py's limit)."""
        out = {}
        for param, whole in originals.items():
            part = self.sliced.get(param)
            if part is None:
                out[param] = whole
            elif has_storage(part):
                out[part] = slice_local(whole, split_dim(part), part.tp_chunks, self.tp)  # type: ignore[arg-type,attr-defined]
        self.sliced = {}
        return out

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that does not compose with TP yet (before the engine is built)."""
        if isinstance(optimizer, OneBitAdam):
            raise ValueError("tensor_parallel with 1-bit Adam is not built yet (after its warm-up each rank keeps its "
                             "own gradients and the momenta are averaged by the compressed all-reduce over the data "
                             "group: neither the clipping norm over tensor x data nor its checkpoints' per-rank "
                             "error-feedback residuals are composed with the TP slices): use AdamW / Adam / SGD, or "
                             "drop tensor_parallel")

    def norm_weight(self, param: nn.Parameter) -> float:
        """The share of ``param``'s norm terms this rank leaves out (Note [norm over tensor x data])."""
        return 0.0 if split_dim(param) is not None else 1.0 - 1.0 / self.config.size


def _holds_values(t: torch.Tensor) -> bool:
    return not t.is_meta and has_storage(t)


def refuse_pipeline_checkpoint(config: TensorParallelConfig, pipelined: bool, from_shards: bool) -> None:
    """A checkpoint of a pipeline whose stages are split by TP is written from the engine's shards only (Note
    [pipeline x TP shards] in pipeline_checkpoint.py): the consolidated format (and the sharded one at ZeRO
    stage 0, or after fit) is refused before anything is written. Loading any checkpoint is built."""
    if config.enabled and pipelined and not from_shards:
        raise NotImplementedError(
            f"saving a consolidated checkpoint of pipeline x tensor_parallel={config.size} is not built yet (only "
            "the sharded format, written during fit from the shards of ZeRO stage >= 1): use "
            "checkpoint_format='sharded' or 'auto' with ZeRO stage >= 1 and save during fit (ModelCheckpoint, or "
            "trainer.save_checkpoint in a callback)")


def apply_tensor_parallel(module: nn.Module, mesh: ProcessMesh, settings: Settings,
          previous: StrategyTensorParallel | None = None) -> StrategyTensorParallel | None:
    """Tensor parallelism of ``settings`` applied to ``module`` on ``mesh`` (``None``: off): the planned layers
    replaced by this rank's slices. ``previous``, the last setup's on the same mesh, is kept: it knows the module it
    split already (``validate`` then ``fit`` of one module)."""
    if not mesh.dims.tensor_enabled:
        return None
    tensor = previous if previous is not None and previous.mesh is mesh else \
        StrategyTensorParallel(settings.parallel.tensor, mesh)
    tensor.apply(module)
    return tensor
