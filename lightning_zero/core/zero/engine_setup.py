"""What :class:`~lightning_zero.core.zero.engine.ZeroEngine` checks and does once, at construction.

The same model and settings on every rank (before the first collective), rank 0's values broadcast,
the optimizer that reduces its own gradients (1-bit Adam), and the module's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.reliability.agreement import check_same_everywhere
from lightning_zero.core.zero.config import ZeroStage
from lightning_zero.core.zero.flat_param import FlatParamGroup


def check_same_structure(names: Mapping[nn.Parameter, str], optimizer: Optimizer | None,
                         settings: Mapping[str, str], comm: DataParallelComm) -> None:
    """Refuse, on every rank and naming the first difference, parameters or settings that differ across ranks."""
    entries = [(f"parameter {n!r}", f"shape={tuple(p.shape)} dtype={p.dtype} requires_grad={p.requires_grad}")
               for p, n in names.items()]
    if optimizer is not None:
        entries.append(("optimizer param groups (parameters per group)",
                        repr([len(g["params"]) for g in optimizer.param_groups])))
    entries += [(f"setting {k}", str(v)) for k, v in settings.items()]
    check_same_everywhere(
        entries, comm,
        "Build the same model with the same configuration on every rank: set the seed before constructing "
        "it, do not make layers or settings depend on the rank, and give every node the same config.",
    )


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, names: Mapping[nn.Parameter, str], all_groups: list[FlatParamGroup],
                         comm: DataParallelComm) -> None:
    """Make parameters and buffers identical on every rank (as DDP does at construction)."""
    if not comm.active:
        return
    for g in all_groups:
        if g.shard is None:  # stage 3 broadcast its units while sharding them
            comm.broadcast(g.flat)
    in_flat = {s.param for g in all_groups for s in g.slots}
    for p in names:
        if p not in in_flat:
            comm.broadcast(p.data)
    for b in module.buffers():
        comm.broadcast(b)


class SelfReducingOptimizer(Protocol):
    """An optimizer that averages over the ranks itself once :meth:`reduces_gradients_itself` says so
    (:class:`~lightning_zero.core.comm.onebit_adam.OneBitAdam`); until then the engine reduces as usual."""

    def bind_comm(self, comm: DataParallelComm) -> None: ...

    def reduces_gradients_itself(self) -> bool: ...


def self_reducing(optimizer: Optimizer, stage: ZeroStage, comm: DataParallelComm) -> SelfReducingOptimizer | None:
    """``optimizer`` when it reduces its own gradients (checked to run at stage 0, bound to ``comm``), else ``None``."""
    if not (hasattr(optimizer, "reduces_gradients_itself") and hasattr(optimizer, "bind_comm")):
        return None
    if stage.shards_optimizer:
        raise ValueError(
            f"{type(optimizer).__name__} compresses the all-reduce of every rank's whole momentum, which needs "
            f"whole local gradients and optimizer state on each rank: use it with ZeRO stage 0, not {stage} "
            "(stages 1-3 partition that state; a compressed stage 1 is not built)."
        )
    optimizer.bind_comm(comm)  # type: ignore[attr-defined]
    return optimizer  # type: ignore[return-value]


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the module's first floating parameter (fp32 without one)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
