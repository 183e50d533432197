"""Checkpoints of an expert-parallel run in the unsplit model's terms: every expert parameter (and its Adam moments)
whole, [E, ...], as a run without expert parallelism holds it (docs/expert_parallel.md, Checkpoints).

Saving gathers each expert tensor over the expert-parallel group (every rank's E / P experts, in rank order: the
experts' order); loading a whole state into a split module cuts each to this rank's experts (Note [expert split] in
experts.py). So a checkpoint resumes at any expert-parallel size, any data size, or without expert parallelism, and
``lightning-zero convert`` gives the state dict the unsplit model (a Hugging Face model included) loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.checkpoint.slices import CutOnRead
from lightning_zero.core.comm.deferred import strategy_collective
from lightning_zero.moe.dispatch import ExpertGroup
from lightning_zero.moe.experts import ExpertSplit, expert_split_of


def _gathered(ep: ExpertGroup, value: Tensor) -> Tensor:
    """The whole [E, ...] tensor from every rank's rows (a collective over the expert-parallel group)."""
    if ep.size == 1:
        return value
    pieces = [torch.empty_like(value) for _ in range(ep.size)]
    with strategy_collective("expert-parallel all_gather"):
        dist.all_gather(pieces, value.contiguous(), group=ep.group)
    return torch.cat(pieces)


def _local(value: Tensor, split: ExpertSplit) -> Tensor:
    """This rank's experts of a whole [E, ...] tensor (one of the local shape, saved split, is taken as it is)."""
    return split.local(value) if value.shape[0] == split.num_experts else value


class ExpertParallelCheckpoint:
    """Translates between this rank's expert slices and the unsplit model's tensors.

    Args:
        ep: this rank's expert-parallel group.
    """

    def __init__(self, ep: ExpertGroup) -> None:
        self.ep = ep

    @torch.no_grad()
    def unsplit_state_dict(self, state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
        """``state`` (the module's keys) with every expert tensor whole; every rank calls it together."""
        params = dict(module.named_parameters(remove_duplicate=False))
        out: dict[str, Any] = {}
        for key, value in state.items():
            split = expert_split_of(params[key]) if key in params else None
            out[key] = value if split is None else _gathered(self.ep, value)
        return out

    @torch.no_grad()
    def unsplit_optimizer_state(self, state: Mapping[str, Any], params: list[nn.Parameter]) -> dict[str, Any]:
        """A ``torch.optim`` state dict (``params[i]``: index ``i``'s parameter) with the per-element state of expert
        parameters whole; every rank calls it together."""
        per_param: dict[Any, dict[str, Any]] = {}
        for idx in sorted(state["state"], key=int):
            param = params[int(idx)]
            entry = dict(state["state"][idx])
            if expert_split_of(param) is not None:
                for key in sorted(entry):
                    v = entry[key]
                    if isinstance(v, Tensor) and v.shape == param.shape:
                        entry[key] = _gathered(self.ep, v)
            per_param[idx] = entry
        return {**state, "state": per_param}

    @staticmethod
    def split_state_dict(state: Mapping[str, Tensor], module: nn.Module, prefix: str = "") -> Mapping[str, Tensor]:
        """``state`` (whole tensors) as this rank's module holds it: expert tensors cut to its experts, on access."""
        params = dict(module.named_parameters(remove_duplicate=False))
        splits = {prefix + k: s for k, p in params.items() if (s := expert_split_of(p)) is not None}
        return CutOnRead(state, {k: (lambda v, s=s: _local(v, s)) for k, s in splits.items()})

    @staticmethod
    def split_optimizer_state(state: Mapping[str, Any], params: list[nn.Parameter]) -> dict[str, Any]:
        """A whole ``torch.optim`` state dict cut to this rank's experts (``params[i]``: index ``i``'s parameter)."""
        out: dict[Any, dict[str, Any]] = {}
        for idx, entry in state["state"].items():
            param = params[int(idx)]
            split = expert_split_of(param)
            whole = split.whole_shape(tuple(param.shape)) if split is not None else None
            out[idx] = {k: split.local(v) if split is not None and isinstance(v, Tensor) and tuple(v.shape) == whole
                        else v for k, v in dict(entry).items()}
        return {**state, "state": out}
