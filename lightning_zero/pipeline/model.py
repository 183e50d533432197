"""The pipeline protocol of a module, and splitting it into this rank's local chunks.

Note [pipeline protocol]
    A module takes part in a pipeline by exposing its model as an ordered sequence of layers and a
    loss function:

    * ``pipeline_layers() -> Sequence[nn.Module]``: layer ``i``'s output is layer ``i + 1``'s input
      (a tensor, or a tuple of tensors passed as positional arguments); the first layer takes the
      batch's inputs, the last one's output goes to the loss. Every trainable parameter of the
      module must belong to some layer; a parameter used by layers of several stages (a tied
      embedding and output head) is kept on each of them and its gradients are summed across them.
    * ``pipeline_loss(output, target) -> Tensor``: the mean loss of one micro-batch.
    * optional ``pipeline_batch(batch) -> (inputs, target)``: default ``(batch[0], batch[1])``.

Each rank keeps only the layers of its own chunks; the other stages' parameters keep their identity
and shape but lose their storage (a NaN placeholder), so a rank holds ``1/stages`` of the model;
``reassemble`` (after fit) broadcasts them back from their stages.

Note [split once]
    The split is decided once, by :func:`hold_stage`, before anything else changes the module: the chunk
    boundaries, the tied stage sets (their groups) and this stage's parameters, the other stages' becoming
    placeholders then, so tensor parallelism slices them into placeholders of the slices' shapes. What a
    rank runs (:func:`split_module`: the chunks, the parameters' names and ties) is read from the layers
    once every rewrite of them is done, with the bounds planned before: the plan may have replaced
    modules, and so parameters, inside the layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.pipeline.partition import layer_weights, partition, stage_layers, stages_of

PROTOCOL_HELP = (
    "add `pipeline_layers(self) -> Sequence[nn.Module]` (the model as an ordered sequence of layers, each "
    "taking the previous one's output) and `pipeline_loss(self, output, target) -> Tensor` (the mean loss of a "
    "micro-batch) to the LightningModule; optionally `pipeline_batch(self, batch) -> (inputs, target)`. "
    "See docs/pipeline.md"
)


def pipeline_layers_of(module: nn.Module) -> list[nn.Module]:
    """The module's layers (Note [pipeline protocol]); raises naming what to add."""
    missing = [name for name in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(f"{type(module).__name__} does not follow the pipeline protocol (no {missing}): "
                        f"{PROTOCOL_HELP}.")
    layers = list(module.pipeline_layers())  # type: ignore[operator]
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise TypeError(f"{type(module).__name__}.pipeline_layers() must return a non-empty sequence of nn.Modules, "
                        f"got {[type(x).__name__ for x in layers]}: {PROTOCOL_HELP}.")
    in_layers = {p for layer in layers for p in layer.parameters()}
    stray = [n for n, p in module.named_parameters() if p.requires_grad and p not in in_layers]
    if stray:
        raise ValueError(f"Trainable parameters {stray[:5]} of {type(module).__name__} belong to no layer of "
                         "pipeline_layers(): every parameter must live in a pipeline layer (or be frozen).")
    return layers


def split_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch (Note [pipeline protocol])."""
    custom = getattr(module, "pipeline_batch", None)
    if callable(custom):
        return custom(batch)
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"A pipelined batch must be (inputs, target); got {type(batch).__name__}. Add "
                    f"`pipeline_batch(self, batch) -> (inputs, target)` to {type(module).__name__}.")


class Chunk(nn.Module):
    """Consecutive layers run in order, with activation checkpointing every ``interval`` layers."""

    def __init__(self, layers: Sequence[nn.Module], interval: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.interval = interval

    def _run(self, start: int, end: int, *x: Any) -> Any:
        out: Any = x
        for layer in self.layers[start:end]:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out

    def forward(self, *x: Any) -> Any:
        step = self.interval or len(self.layers)
        out: Any = x
        for start in range(0, len(self.layers), step):
            args = out if isinstance(out, tuple) else (out,)
            if self.interval and torch.is_grad_enabled():
                out = checkpoint(self._run, start, start + step, *args, use_reentrant=False)
            else:
                out = self._run(start, start + step, *args)
        return out


@dataclass
class LocalModel:
    """This rank's part of the split model.

    Attributes:
        chunks: the local chunks (``Chunk`` modules), in schedule order.
        chunk_ids: their indices in the whole pipeline.
        module: one module holding every local layer (``layers.<i>``): what the ZeRO engine partitions.
        names: local parameter -> its name in the unsplit module (checkpoint keys).
        ties: stage sets sharing parameters -> the local parameters they share (empty when none).
        owner_stage: every parameter -> the first stage using it (a tied gradient counts once in norms).
        bounds: layer boundaries of every chunk (``partition``'s output).
        unsplit: every parameter of the module -> its name, in module order.
    """

    chunks: list[Chunk]
    chunk_ids: list[int]
    module: nn.Module
    names: dict[nn.Parameter, str]
    ties: dict[tuple[int, ...], list[nn.Parameter]]
    owner_stage: dict[nn.Parameter, int]
    bounds: list[int]
    unsplit: dict[nn.Parameter, str]


def plan_split(module: nn.Module, config: PipelineConfig) -> tuple[list[nn.Module], list[int], list[tuple[int, ...]]]:
    """Layers, chunk boundaries and the stage sets that share parameters (no communication)."""
    layers = pipeline_layers_of(module)
    bounds = partition(layer_weights(layers, config.partition_method), config.chunks)
    tie_sets = sorted({tuple(sorted(s)) for s in stages_of(layers, bounds, config).values() if len(s) > 1})
    return layers, bounds, tie_sets


@dataclass(frozen=True)
class StagePlan:
    """A stage's share of the module, decided once before anything else changes it (Note [split once]).

    Attributes:
        bounds: the layer boundaries of every chunk (``partition``'s output).
        tie_sets: the stage sets sharing a parameter (each gets a group).
        chunk_ids: the stage's chunks, in schedule order.
        layer_ids: the indices of their layers, in that order.
        local: the stage's parameters; every other parameter of the module is a placeholder by then.
    """

    bounds: list[int]
    tie_sets: list[tuple[int, ...]]
    chunk_ids: list[int]
    layer_ids: list[int]
    local: frozenset[nn.Parameter]


def hold_stage(module: nn.Module, config: PipelineConfig, stage: int) -> StagePlan:
    """Plan the split (:func:`plan_split`) and keep ``stage``'s parameters: the other stages' (and the frozen ones
    outside every layer) become storage-less placeholders, their identity and shape kept."""
    layers, bounds, tie_sets = plan_split(module, config)
    chunk_ids, layer_ids = stage_layers(config, stage, bounds)
    local = frozenset(p for i in layer_ids for p in layers[i].parameters())
    with torch.no_grad():
        for p in module.parameters():
            if p not in local:  # one NaN element viewed at its shape: no storage
                p.data = torch.full((), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)
    return StagePlan(bounds, tie_sets, chunk_ids, layer_ids, local)


def split_module(module: nn.Module, config: PipelineConfig, interval: int, plan: StagePlan) -> LocalModel:
    """The chunks of ``plan``'s stage, read from the module's layers now: tensor parallelism may have replaced
    modules (and so parameters) inside them since :func:`hold_stage` (Note [split once])."""
    layers = pipeline_layers_of(module)
    bounds = plan.bounds
    chunks = [Chunk(layers[bounds[c] : bounds[c + 1]], interval) for c in plan.chunk_ids]
    holder = nn.Module()
    holder.layers = nn.ModuleList(layers[i] for i in plan.layer_ids)
    unsplit = {}
    for name, p in module.named_parameters():
        unsplit.setdefault(p, name)
    names = {p: unsplit[p] for p in holder.parameters()}
    using = stages_of(layers, bounds, config)
    owner = {p: min(s) for p, s in using.items()}
    ties: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for p in {p for i in plan.layer_ids for p in layers[i].parameters()}:
        if len(using[p]) > 1:
            ties.setdefault(tuple(sorted(using[p])), []).append(p)
    for plist in ties.values():
        plist.sort(key=lambda p: unsplit[p])
    return LocalModel(chunks, plan.chunk_ids, holder, names, ties, owner, bounds, unsplit)


@torch.no_grad()
def reassemble(local: LocalModel, broadcast: Any, dtype_of: Any) -> None:
    """Give every rank the whole module again: each parameter is broadcast from the first stage that
    holds it (``broadcast(tensor, from_stage)``, a collective over the pipeline group), in the dtype
    it has there (``dtype_of(param)``)."""
    for p in local.unsplit:  # the same order on every rank
        owner = local.owner_stage[p]
        buf = p.data if p in local.names else torch.empty(p.shape, dtype=dtype_of(p), device=p.device)
        broadcast(buf, owner)
        p.data = buf
