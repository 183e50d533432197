"""Checkpoints of a tensor-parallel run, in the unsplit model's terms (docs/tensor_parallel.md, Checkpoints).

* Sharded (ZeRO stage >= 1): every rank writes its own shards of its own TP slices; the TP ranks'
  descriptions are merged on rank 0 into one ``metadata.json`` whose split parameters (and their Adam
  moments) are whole tensors made of parts (Note [TP slices in checkpoints] in checkpoint/slices.py). No
  rank receives another's slices. Read at any TP size (1 included: a run without TP) and data size.
* Consolidated: each split tensor is all-gathered over the TP group and unsplit, so the file holds the
  unsplit model and the unsplit optimizer state, as a run without TP writes them.

Loading a whole (unsplit) state into a split module cuts each split tensor to this rank's slice
(:func:`split_state_dict`, :func:`split_optimizer_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.checkpoint.collect import StageLayout
from lightning_zero.checkpoint.layout import FORMAT_VERSION, TensorParallelRecord
from lightning_zero.checkpoint.plain import CheckpointError
from lightning_zero.checkpoint.slices import CutOnRead, SplitTag, parts_ref, split_of
from lightning_zero.core.comm.deferred import strategy_collective
from lightning_zero.core.mesh.dims import Axis, ParallelDims
from lightning_zero.core.zero.engine import ZeroEngine
from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.layers import slice_tensor, unslice_tensors

Merge = Callable[[dict[str, Any] | None], dict[str, Any] | None]


def _gathered(tp: TPGroup, value: Tensor, tag: SplitTag) -> Tensor:
    """The unsplit tensor from every TP rank's slice (a collective over the TP group, on the group's device:
    after a fit the module is on the CPU, which NCCL refuses), where ``value`` is."""
    return unslice_tensors(tp.all_gather_pieces(value), tag.dim, tag.chunks)


def _gathered_objects(tp: TPGroup, value: Any) -> list[Any]:
    """Every TP rank's ``value`` (a collective over the TP group)."""
    out: list[Any] = [None] * tp.size
    with strategy_collective("tensor-parallel all_gather_object"):
        dist.all_gather_object(out, value, group=tp.group)
    return out


class TensorParallelCheckpoint:
    """Translates between this TP rank's state and the unsplit model's.

    Args:
        tp: this rank's TP group.
        dims: the mesh's sizes (where each data rank's file is).
        rank: this global rank.
    """

    def __init__(self, tp: TPGroup, dims: ParallelDims, rank: int) -> None:
        self.tp, self.dims, self.rank = tp, dims, rank

    # ----------------------------------------------------------------------------- consolidated
    @torch.no_grad()
    def unsplit_state_dict(self, state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
        """``state`` (the module's keys, split tensors as this rank's slices) with every split tensor whole.
        Every TP rank calls this together (the same keys in the same order)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        out: dict[str, Any] = {}
        for key, value in state.items():
            tag = split_of(params[key]) if key in params else None
            out[key] = value if tag is None else _gathered(self.tp, value, tag)
        return out

    @torch.no_grad()
    def unsplit_optimizer_state(self, state: Mapping[str, Any], params: list[nn.Parameter]) -> dict[str, Any]:
        """A ``torch.optim`` state dict (``params[i]``: the parameter of index ``i``) with the per-element
        state of split parameters whole. Every TP rank calls this together."""
        per_param: dict[int, dict[str, Any]] = {}
        for idx in sorted(state["state"]):
            tag = split_of(params[int(idx)])
            entry = dict(state["state"][idx])
            if tag is not None:
                for key in sorted(entry):
                    v = entry[key]
                    if isinstance(v, Tensor) and v.shape == params[int(idx)].shape:
                        entry[key] = _gathered(self.tp, v, tag)
            per_param[idx] = entry
        return {**state, "state": per_param}

    # ----------------------------------------------------------------------------- loading whole states
    @staticmethod
    def split_state_dict(state: Mapping[str, Tensor], module: nn.Module, prefix: str = "") -> Mapping[str, Tensor]:
        """``state`` (whole tensors) as this rank's module holds it: split tensors cut to its slices, on access."""
        params = dict(module.named_parameters(remove_duplicate=False))
        tags = {prefix + k: t for k, p in params.items() if (t := split_of(p)) is not None}
        return CutOnRead(state, {k: (lambda v, t=t: slice_tensor(v, t)) for k, t in tags.items()})

    @staticmethod
    def split_optimizer_state(state: Mapping[str, Any], params: list[nn.Parameter]) -> dict[str, Any]:
        """A whole ``torch.optim`` state dict cut to this rank's slices (``params[i]``: index ``i``'s parameter)."""
        out: dict[int, dict[str, Any]] = {}
        for idx, entry in state["state"].items():
            tag = split_of(params[int(idx)])
            whole = tag.whole_shape(tuple(params[int(idx)].shape)) if tag is not None else None
            out[idx] = {k: slice_tensor(v, tag) if tag is not None and isinstance(v, Tensor)
                        and tuple(v.shape) == whole else v for k, v in dict(entry).items()}
        return {**state, "state": out}

    # ----------------------------------------------------------------------------- sharded
    def sharded_parts(self, engine: ZeroEngine, module: nn.Module) -> tuple[StageLayout, Merge]:
        """This TP rank's place in a sharded checkpoint and the merge of the TP ranks' metadata (Note [TP slices
        in checkpoints]); one collective over the TP group (the group counts)."""
        from lightning_zero.core.zero.optimizer import original_index

        assert engine.sharded is not None
        counts = _gathered_objects(self.tp, len(engine.all_groups))
        here = self.dims.coordinates(self.rank)
        whole = {}
        if self.rank == 0:  # the module's buffers, written once
            whole = {k: v for k, v in module.state_dict(keep_vars=True).items() if not isinstance(v, nn.Parameter)}
        index = original_index(engine.sharded)
        layout = StageLayout(
            group_offset=sum(counts[: self.tp.rank]),
            file_of=lambda dp: self.dims.rank_of({**here, Axis.DATA: dp}),
            key_of=engine.names, index_of=index, owns=lambda p: True,
            param_groups=engine.sharded.original_params, whole=whole,
        )
        by_index = {i: p for p, i in index.items()}

        def merge(meta: dict[str, Any] | None) -> dict[str, Any] | None:
            parts = _gathered_objects(self.tp, meta)
            if self.rank != 0:
                return None
            missing = [t for t, part in enumerate(parts) if part is None]
            if missing:
                raise CheckpointError(f"Tensor-parallel rank(s) {missing} could not describe their shards (their "
                                      "ranks' tracebacks say why); nothing was published.")
            return self._merged(parts, module, engine.names, by_index)

        return layout, merge

    def _merged(self, parts: list[dict[str, Any]], module: nn.Module, names: Mapping[nn.Parameter, str],
                by_index: Mapping[int, nn.Parameter]) -> dict[str, Any]:
        """Rank 0: the TP ranks' metadata as one checkpoint's, split tensors as parts (version 2)."""
        refs = [dict((k, r) for k, r in part["state_dict"]) for part in parts]
        params = dict(module.named_parameters(remove_duplicate=False))
        entries, split = [], {}
        for key in module.state_dict(keep_vars=True):
            p = params.get(key)
            name = names[p] if p is not None else key
            tag = split_of(p) if p is not None else None
            if tag is None:
                entries.append([key, refs[0][name]])
                continue
            split[key] = (tag.dim, tag.chunks)
            whole = list(tag.whole_shape(tuple(p.shape)))
            entries.append([key, parts_ref([r[name] for r in refs], tag.dim, tag.chunks, whole)])
        optimizers = []
        for j, opt in enumerate(parts[0]["optimizers"]):
            state = {}
            for idx, keys in opt["state"].items():
                p = by_index[int(idx)]
                tag = split_of(p)
                state[idx] = {k: parts_ref([part["optimizers"][j]["state"][idx][k] for part in parts], tag.dim,
                                           tag.chunks, list(tag.whole_shape(tuple(p.shape))))
                              if tag is not None and "flat" in ref else ref for k, ref in keys.items()}
            optimizers.append({**opt, "state": state})
        groups = [g for part in parts for g in part["groups"]]
        record = TensorParallelRecord(self.tp.size, split)
        return {**parts[0], "version": FORMAT_VERSION, "groups": groups, "state_dict": entries,
                "optimizers": optimizers, "tensor_parallel": record.to_json()}
