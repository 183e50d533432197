"""Checkpoints of a pipelined run, in the unsplit model's terms.

Both checkpoint formats hold the unsplit model: the ``state_dict`` keyed by the unsplit module's
parameter names and the optimizer state numbered as the unsplit ``configure_optimizers`` numbers it.

* Sharded (``checkpoint_format="auto"`` at ZeRO stage >= 1, or ``"sharded"``): every rank writes its
  own stage's shards; the stages' descriptions are merged into one metadata file
  (:meth:`PipelineCheckpoint.sharded_parts`, Note [pipelined shards] in checkpoint/collect.py).
  No rank receives another stage's weights.
* Consolidated: each stage contributes its own parameters (gathered over its data-parallel group
  first at stage 3, masters at mixed precision), sent over the pipeline group.

So a pipelined checkpoint resumes without a pipeline, and any checkpoint of the unsplit model resumes
into a pipeline: weights load into the whole module before the split (or, built on meta, each stage
reads its own layers), and :meth:`PipelineCheckpoint.load_optimizer_state` picks this stage's entries
of the optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.checkpoint.collect import StageLayout
from lightning_zero.checkpoint.plain import CheckpointError
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.core.zero.optimizer_state import full_optimizer_state, load_full_optimizer_state
from lightning_zero.pipeline.mesh import PipelineGroups
from lightning_zero.pipeline.model import LocalModel

Cut = Callable[[dict[str, Any], list[nn.Parameter]], dict[str, Any]]


def _numbering(groups: list[list[nn.Parameter]]) -> dict[nn.Parameter, int]:
    """torch.optim's state-dict ids: the tensors of all param groups, numbered consecutively."""
    out: dict[nn.Parameter, int] = {}
    for params in groups:
        for p in params:
            out.setdefault(p, len(out))
    return out


class PipelineCheckpoint:
    """Translates between this stage's state and the unsplit model's.

    Args:
        local: this rank's split of the model.
        groups: its process groups.
        original_groups: the optimizer's param groups as ``configure_optimizers`` built them (all
            stages' parameters), before the other stages' parameters were dropped.
    """

    def __init__(self, local: LocalModel, groups: PipelineGroups, original_groups: list[list[nn.Parameter]]) -> None:
        self.local, self.groups = local, groups
        self.original = _numbering(original_groups)
        self.original_groups = original_groups

    def _from_owner(self, value: Tensor | None, p: nn.Parameter, dtype: torch.dtype) -> Tensor:
        owner = self.local.owner_stage[p]
        buf = value.detach().to(dtype).clone() if value is not None and owner == self.groups.stage else (
            torch.empty(p.shape, dtype=dtype, device=p.device))
        if self.groups.stages > 1:
            dist.broadcast(buf, src=self.groups.peer(owner), group=self.groups.pp)
        return buf

    @torch.no_grad()
    def state_dict(self, engine: ZeroEngine, module: nn.Module) -> dict[str, Tensor]:
        """The unsplit module's state dict, whole on every rank (a collective over the world)."""
        local_state = engine.full_state_dict()  # stage 3 gathers this stage's units
        holder_names = {p: n for n, p in engine.module.named_parameters()}
        masters = engine.full_master_params() if engine.separate_master else {}
        out: dict[str, Tensor] = {}
        for p, key in self.local.unsplit.items():  # the same order on every rank
            dtype = engine.dtypes.master_dtype if engine.separate_master and p.requires_grad else p.dtype
            value = masters.get(p)
            if value is None and p in holder_names:
                value = local_state[holder_names[p]]
            out[key] = self._from_owner(value, p, dtype)
        for name, p in module.named_parameters(remove_duplicate=False):  # tied aliases (state_dict keeps both)
            out.setdefault(name, out[self.local.unsplit[p]])
        for name, b in module.named_buffers():
            out[name] = b.detach().clone()
        return {k: out[k] for k in module.state_dict() if k in out}  # the module's key order

    @torch.no_grad()
    def optimizer_state(self, engine: ZeroEngine) -> dict[str, Any]:
        """The optimizer state as the unsplit optimizer numbers it (a collective over the world)."""
        if engine.sharded is not None:
            mine = full_optimizer_state(engine.sharded, engine.comm)
        else:
            mine = engine.optimizer.state_dict()
        restricted = _numbering([list(g["params"]) for g in engine.optimizer.param_groups])
        if engine.sharded is not None:
            restricted = _numbering(engine.sharded.original_params)
        by_id = {i: p for p, i in restricted.items()}
        stage = self.groups.stage
        own = {self.original[by_id[int(i)]]: s for i, s in mine["state"].items()
               if self.local.owner_stage[by_id[int(i)]] == stage}
        parts: list[Any] = [own]
        if self.groups.stages > 1:
            parts = [None] * self.groups.stages
            dist.all_gather_object(parts, own, group=self.groups.pp)
        state = {i: s for part in parts for i, s in part.items()}
        param_groups = [{**{k: v for k, v in saved.items() if k != "params"},
                         "params": [self.original[p] for p in params]}
                        for saved, params in zip(mine["param_groups"], self.original_groups)]
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def sharded_parts(self, engine: ZeroEngine, module: nn.Module) -> tuple[StageLayout, Any]:
        """This stage's place in a sharded checkpoint and the merge of the stages' metadata
        (Note [pipelined shards]); one collective over the pipeline group (the stages' group counts)."""
        groups, stage = self.groups, self.groups.stage
        counts = [len(engine.all_groups)]
        if groups.stages > 1:
            counts = [0] * groups.stages
            dist.all_gather_object(counts, len(engine.all_groups), group=self.groups.pp)
        zero_ranks = groups.mesh.ranks(*groups.mesh.dims.zero_axes)  # this stage's ZeRO group: its shard files
        whole = {}
        if groups.mesh.rank == 0:  # the unsplit module's buffers, as the consolidated format writes them
            whole = {k: v for k, v in module.state_dict(keep_vars=True).items() if not isinstance(v, nn.Parameter)}
        layout = StageLayout(
            group_offset=sum(counts[:stage]), file_of=lambda dp: zero_ranks[dp],
            key_of=self.local.unsplit, index_of=self.original,
            owns=lambda p: self.local.owner_stage.get(p) == stage, param_groups=self.original_groups,
            whole=whole,
        )

        def merge(meta: dict[str, Any] | None) -> dict[str, Any] | None:
            parts: list[Any] = [meta]
            if groups.stages > 1:
                parts = [None] * groups.stages
                dist.all_gather_object(parts, meta, group=self.groups.pp)
            if groups.mesh.rank != 0:
                return None
            missing = [stage for stage, part in enumerate(parts) if part is None]
            if missing:
                raise CheckpointError(f"Pipeline stage(s) {missing} could not describe their shards (their "
                                      "ranks' tracebacks say why); nothing was published.")
            return self._merged(parts, module)

        return layout, merge

    def _merged(self, parts: list[dict[str, Any]], module: nn.Module) -> dict[str, Any]:
        """Rank 0: the stages' metadata as one checkpoint's, state-dict keys in the unsplit module's order."""
        refs: dict[str, Any] = {}
        for part in parts:
            for key, ref in part["state_dict"]:
                refs.setdefault(key, ref)
        named = module.named_parameters(remove_duplicate=False)
        canonical = {name: self.local.unsplit.get(p, name) for name, p in named}
        entries = []
        for key in module.state_dict(keep_vars=True):
            ref = refs.get(canonical.get(key, key))
            if ref is None:
                raise CheckpointError(f"No pipeline stage holds {key!r}: every parameter must live in a pipeline "
                                      "layer (docs/pipeline.md).")
            entries.append([key, ref])
        merged = {**parts[0], "groups": [g for part in parts for g in part["groups"]], "state_dict": entries}
        if parts[0]["optimizers"]:
            state = {k: v for part in parts for k, v in part["optimizers"][0]["state"].items()}
            merged["optimizers"] = [{**parts[0]["optimizers"][0], "state": state}]
        return merged

    def load_optimizer_state(self, engine: ZeroEngine, full: dict[str, Any], cut: Cut | None = None) -> None:
        """Load an unsplit optimizer state: this stage's entries, renumbered for its optimizer; ``cut`` (tensor
        parallelism) takes that state and its parameters in index order and returns it cut to this rank's slices."""
        groups = engine.sharded.original_params if engine.sharded is not None else [
            list(g["params"]) for g in engine.optimizer.param_groups]
        restricted = _numbering(groups)
        saved_state = full.get("state", {})
        state = {}
        for p, rid in restricted.items():
            entry = saved_state.get(self.original[p], saved_state.get(str(self.original[p])))
            if entry is not None:
                state[rid] = dict(entry)  # a sharded checkpoint's entries are read here, this stage's only
        saved_groups = full.get("param_groups", [])
        if len(saved_groups) != len(groups):
            raise ValueError(f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one "
                             f"{len(groups)}. Resume with the same `configure_optimizers`.")
        param_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": [restricted[p] for p in ps]}
                        for saved, ps in zip(saved_groups, groups)]
        local = {"state": state, "param_groups": param_groups}
        if cut is not None:
            local = cut(local, list(restricted))
        if engine.sharded is not None:
            load_full_optimizer_state(engine.sharded, local)
        else:
            engine.optimizer.load_state_dict(local)
