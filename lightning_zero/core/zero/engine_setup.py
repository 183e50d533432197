"""What :class:`~lightning_zero.core.zero.engine.ZeroEngine` checks and does once, at construction.

The same model and settings on every rank (before the first collective), the parameters partitioned into flat
groups (stage 3: sharded units), rank 0's values broadcast, the optimizer over this rank's masters, the optimizer
that reduces its own gradients (1-bit Adam), and the module's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.agreement import check_same_everywhere
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.choices import ZeroStage
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.experts.partition import bind_partitioned
from lightning_zero.core.offload.store import open_shard_store
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3.materialize import ParamInitFn
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.sharded_unit import ShardedUnit
from lightning_zero.core.stage3.sharding import apply_stage3
from lightning_zero.core.zero.optimizer import ShardedOptimizer
from lightning_zero.core.zero.optimizer_state import broadcast_master_init


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


def partition_parameters(module: nn.Module, names: dict[nn.Parameter, str], groups: list[list[nn.Parameter]],
                         comm: DataParallelComm, config: ZeroConfig, param_init_fn: ParamInitFn | None,
                         init_seed: int, experts: Set[nn.Parameter] = frozenset(),
                         ) -> tuple[list[ShardedUnit], Stage3Runtime | None, list[FlatParamGroup]]:
    """``(units, runtime, all flat groups)``: stage 3 binds, initialises (meta-built models), broadcasts and shards
    one unit at a time (``core/stage3/sharding.py``); the other stages bind one flat group per optimizer param
    group, with no units and no runtime, and a second one for the group's ``experts`` (sharded over the
    expert-data group, Note [expert axes] in core/mesh/dims.py) when it holds some."""
    if config.stage.shards_parameters:
        return apply_stage3(module, names, groups, comm, config, param_init_fn, init_seed, experts)
    return [], None, [g for i, params in enumerate(groups) for g in bind_partitioned(params, experts, comm, i, True)]


def sharded_optimizer(optimizer: Optimizer | None, config: ZeroConfig, dtypes: DtypePolicy, offload: OffloadConfig,
                      comm: DataParallelComm, units: list[ShardedUnit], groups: list[FlatParamGroup],
                      managed: list[nn.Parameter], master_init: Mapping[nn.Parameter, torch.Tensor] | None,
                      experts: Set[nn.Parameter] = frozenset()) -> ShardedOptimizer | None:
    """Stage >= 1: the optimizer over this rank's master shards; stage 0: over per-parameter views of a whole
    separate master (mixed precision), or ``None`` when the optimizer steps the parameters themselves."""
    separate_master = not dtypes.master_is_param_view
    if optimizer is None or not (config.stage.shards_optimizer or separate_master):
        return None
    if separate_master and master_init:  # rank 0's values everywhere, as for the parameters
        master_init = broadcast_master_init(master_init, managed, dtypes.master_dtype, comm, experts)
    store = open_shard_store(offload, comm.rank, units, groups, dtypes.master_dtype)  # where the shards live, once
    return ShardedOptimizer(optimizer, groups, dtypes.master_dtype, whole=not config.stage.shards_optimizer,
                            master_init=master_init, store=store)


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, names: Mapping[nn.Parameter, str], all_groups: list[FlatParamGroup],
                         comm: DataParallelComm, experts: Set[nn.Parameter] = frozenset()) -> None:
    """Make parameters and buffers identical on every rank (as DDP does at construction); expert parameters on
    every rank of their expert-data group (the other expert-parallel ranks hold other experts)."""
    if not comm.active:
        return
    for g in all_groups:
        if g.shard is None:  # stage 3 broadcast its units while sharding them
            comm.of(g.experts).broadcast(g.flat)
    in_flat = {s.param for g in all_groups for s in g.slots}
    for p in names:
        if p not in in_flat:
            comm.of(p in experts).broadcast(p.data)
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


def norm_shares(groups: list[FlatParamGroup], comm: DataParallelComm, config: ZeroConfig) -> list[float] | None:
    """Stages 0 with expert groups: each flat group's share of its whole-gradient norm terms on this rank (1 / the
    ranks holding the same whole gradient: the data group for dense groups, the expert-data group for the
    experts'), so that one sum over the data group counts every parameter once (Note [counting a parameter
    once] in engine_step.py); ``None`` otherwise (shards: every element is held by one data rank)."""
    if config.stage.shards_optimizer or not any(g.experts for g in groups):
        return None
    return [1.0 / comm.of(g.experts).world_size for g in groups]


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the module's first floating parameter (fp32 without one)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
