"""Checkpoints of a pipelined run, in the unsplit model's terms.

A pipelined run saves Lightning's consolidated checkpoint: the ``state_dict`` keyed by the unsplit
module's parameter names and the optimizer state numbered as the unsplit ``configure_optimizers``
numbers it. Each stage contributes its own parameters (gathered over its data-parallel group
first at stage 3, masters at mixed precision), sent over the pipeline group. So a pipelined
checkpoint resumes without a pipeline, and any checkpoint of the unsplit model (consolidated or
sharded) resumes into a pipeline: weights load into the whole module before the split, and
:meth:`PipelineCheckpoint.local_optimizer_state` picks this stage's entries of the optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.optimizer_state import full_optimizer_state, load_full_optimizer_state
from lightning_zero.pipeline.mesh import PipelineGroups
from lightning_zero.pipeline.model import LocalModel


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
        buf = value.detach().to(dtype).clone() if value is not None and owner == self.groups.mesh.stage else (
            torch.empty(p.shape, dtype=dtype, device=p.device))
        if self.groups.mesh.stages > 1:
            src = self.groups.mesh.global_rank(owner, self.groups.mesh.dp_rank)
            dist.broadcast(buf, src=src, group=self.groups.pp)
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
        stage = self.groups.mesh.stage
        own = {self.original[by_id[int(i)]]: s for i, s in mine["state"].items()
               if self.local.owner_stage[by_id[int(i)]] == stage}
        parts: list[Any] = [own]
        if self.groups.mesh.stages > 1:
            parts = [None] * self.groups.mesh.stages
            dist.all_gather_object(parts, own, group=self.groups.pp)
        state = {i: s for part in parts for i, s in part.items()}
        param_groups = [{**{k: v for k, v in saved.items() if k != "params"},
                         "params": [self.original[p] for p in params]}
                        for saved, params in zip(mine["param_groups"], self.original_groups)]
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def load_optimizer_state(self, engine: ZeroEngine, full: dict[str, Any]) -> None:
        """Load an unsplit optimizer state: this stage's entries, renumbered for its optimizer."""
        groups = engine.sharded.original_params if engine.sharded is not None else [
            list(g["params"]) for g in engine.optimizer.param_groups]
        restricted = _numbering(groups)
        saved_state = full.get("state", {})
        state = {}
        for p, rid in restricted.items():
            entry = saved_state.get(self.original[p], saved_state.get(str(self.original[p])))
            if entry is not None:
                state[rid] = entry
        saved_groups = full.get("param_groups", [])
        if len(saved_groups) != len(groups):
            raise ValueError(f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one "
                             f"{len(groups)}. Resume with the same `configure_optimizers`.")
        param_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": [restricted[p] for p in ps]}
                        for saved, ps in zip(saved_groups, groups)]
        local = {"state": state, "param_groups": param_groups}
        if engine.sharded is not None:
            load_full_optimizer_state(engine.sharded, local)
        else:
            engine.optimizer.load_state_dict(local)
