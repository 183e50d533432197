"""Sharded checkpoints of a pipeline x tensor-parallel run (docs/tensor_parallel.md, Checkpoints).

Note [pipeline x TP shards]
    Every rank writes its own shards of its own TP slices of its own stage. Its flat groups are numbered
    stage-major, then by TP rank (the groups of ``(stage, tp)`` pairs before it come first); its parameters
    carry the unsplit model's state-dict keys and optimizer indices (Note [pipelined shards] in
    checkpoint/collect.py); a parameter tied across stages is referred to from its owning stage only. On
    rank 0 each stage's TP descriptions are merged first, a split parameter (and its Adam moments) becoming
    one parts reference of the whole tensor (Note [TP slices in checkpoints] in checkpoint/slices.py), then
    the stages' are merged as a pipeline's (:meth:`PipelineCheckpoint._merged`). So the file is the ordinary
    format 2 of the unsplit model: it resumes with or without a pipeline, at any TP and data size. Each rank
    sends the split of its own parameters (key / optimizer index -> dim, chunks, whole shape) with its
    metadata: rank 0 holds only placeholders of the other stages' layers.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_zero.checkpoint.collect import StageLayout
from lightning_zero.checkpoint.layout import FORMAT_VERSION, TensorParallelRecord
from lightning_zero.checkpoint.plain import CheckpointError
from lightning_zero.checkpoint.slices import parts_ref, split_of
from lightning_zero.core.comm.deferred import strategy_collective
from lightning_zero.core.mesh.dims import Axis
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.pipeline.checkpoint import PipelineCheckpoint
from lightning_zero.tensor_parallel.checkpoint import Merge, TensorParallelCheckpoint

Split = dict[str, tuple[int, int, list[int]]]  # key or optimizer index -> (dim, chunks, whole shape)


def _everyone(value: Any, world: int) -> list[Any]:
    """Every rank's ``value`` (a collective over the world, recorded for the hang watchdog)."""
    out: list[Any] = [None] * world
    with strategy_collective("all_gather_object (pipeline x TP checkpoint)"):
        dist.all_gather_object(out, value)
    return out


def pipelined_sharded_parts(pipe: PipelineCheckpoint, tp: TensorParallelCheckpoint, engine: ZeroEngine,
                            module: nn.Module) -> tuple[StageLayout, Merge]:
    """This rank's place in a sharded checkpoint of pipeline x TP and the merge of all ranks' metadata (Note
    [pipeline x TP shards]); one collective over the world (the group counts)."""
    dims, rank = tp.dims, tp.rank
    here = dims.coordinates(rank)
    stage, t = here[Axis.PIPELINE], here[Axis.TENSOR]

    def at(s: int, u: int) -> int:  # the data-rank-0 rank of stage s, TP rank u (its groups are everyone's)
        return dims.rank_of({**here, Axis.PIPELINE: s, Axis.DATA: 0, Axis.TENSOR: u})

    counts = _everyone(len(engine.all_groups), dims.world_size)
    pairs = [(s, u) for s in range(dims.pipeline) for u in range(dims.tensor)]
    offset = sum(counts[at(s, u)] for s, u in pairs[: pairs.index((stage, t))])
    whole = {}
    if rank == 0:  # the unsplit module's buffers, written once
        whole = {k: v for k, v in module.state_dict(keep_vars=True).items() if not isinstance(v, nn.Parameter)}
    layout = StageLayout(
        group_offset=offset, file_of=lambda dp: dims.rank_of({**here, Axis.DATA: dp}),
        key_of=pipe.local.unsplit, index_of=pipe.original,
        owns=lambda p: pipe.local.owner_stage.get(p) == stage, param_groups=pipe.original_groups, whole=whole,
    )
    keys, indices = _own_splits(pipe, stage)

    def merge(meta: dict[str, Any] | None) -> dict[str, Any] | None:
        parts = _everyone((meta, keys, indices), dims.world_size)
        if rank != 0:
            return None
        missing = sorted({at(s, u) for s, u in pairs if parts[at(s, u)][0] is None})
        if missing:
            raise CheckpointError(f"Rank(s) {missing} could not describe their shards (their tracebacks say why); "
                                  "nothing was published.")
        stages = [_stage_merged([parts[at(s, u)] for u in range(dims.tensor)]) for s in range(dims.pipeline)]
        merged = pipe._merged(stages, module)
        split = {key: (ref["tp"]["dim"], ref["tp"]["chunks"]) for key, ref in merged["state_dict"] if "tp" in ref}
        return {**merged, "version": FORMAT_VERSION, "tensor_parallel": TensorParallelRecord(dims.tensor,
                                                                                              split).to_json()}

    return layout, merge


def _own_splits(pipe: PipelineCheckpoint, stage: int) -> tuple[Split, Split]:
    """The split of the parameters this stage owns, by unsplit key and by unsplit optimizer index."""
    keys: Split = {}
    indices: Split = {}
    for p, key in pipe.local.unsplit.items():
        tag = split_of(p)
        if tag is None or pipe.local.owner_stage.get(p) != stage:
            continue
        entry = (tag.dim, tag.chunks, list(tag.whole_shape(tuple(p.shape))))
        keys[key] = entry
        if p in pipe.original:
            indices[str(pipe.original[p])] = entry
    return keys, indices


def _stage_merged(parts: list[tuple[dict[str, Any], Split, Split]]) -> dict[str, Any]:
    """One stage's TP ranks' metadata (TP rank order) as one stage's: split tensors as parts references."""
    first, keys, indices = parts[0]
    refs = [dict((k, r) for k, r in meta["state_dict"]) for meta, _, _ in parts]
    entries = []
    for key, ref in first["state_dict"]:
        if key in keys:
            dim, chunks, whole = keys[key]
            ref = parts_ref([r[key] for r in refs], dim, chunks, whole)
        entries.append([key, ref])
    optimizers = []
    for j, opt in enumerate(first["optimizers"]):
        state = {}
        for idx, per_key in opt["state"].items():
            split = indices.get(str(idx))
            state[idx] = {k: parts_ref([meta["optimizers"][j]["state"][idx][k] for meta, _, _ in parts], *split)
                          if split is not None and "flat" in ref else ref for k, ref in per_key.items()}
        optimizers.append({**opt, "state": state})
    groups = [g for meta, _, _ in parts for g in meta["groups"]]
    return {**first, "groups": groups, "state_dict": entries, "optimizers": optimizers}
