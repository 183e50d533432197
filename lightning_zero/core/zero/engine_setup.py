"""What :class:`~lightning_zero.core.zero.engine.ZeroEngine` checks once, at construction (:func:`check_construction`).

The dtypes, the optimizer (element-wise at stage >= 1; reducing its own gradients only at stage 0), the experts'
group, and then the same model and settings on every rank, compared before the first collective that a mismatch
could hang (Note [construction order] in engine.py). Also what couples a pipeline stage's engine to the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm.agreement import check_same_everywhere
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.choices import ZeroStage
from lightning_zero.core.offload.shard_store import ShardStore
from lightning_zero.core.offload.store import open_shard_store, swap_bytes_of
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.precision import DtypePolicy
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.zero.engine_step import NormExcess

# Optimizers whose update of an element depends only on that element's own history, so that
# stepping a 1-D shard equals stepping the whole tensors.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


@dataclass(frozen=True)
class StageCoupling:
    """How a pipeline stage's engine combines its step with the other stages' (Note [deferred reduction]).

    Args:
        model_parallel: the ranks holding the rest of the model (other pipeline stages, other TP ranks), over
            which gradient norms, the overflow decision and the non-finite check are combined (``None``: none).
        norm_excess: ``fn(grads, groups, norm_type)``: the norm share to leave out (tied parameters
            another stage counts).
    """

    model_parallel: DataParallelComm | None = None
    norm_excess: NormExcess | None = None


@dataclass(frozen=True)
class Checked:
    """What :func:`check_construction` handed on: the dtypes, every parameter's name (module order), the trainable
    parameters of each optimizer group (module order), and the optimizer when it reduces its own gradients."""

    dtypes: DtypePolicy
    names: dict[nn.Parameter, str]
    optimizer_groups: list[list[nn.Parameter]]
    self_reducing: SelfReducingOptimizer | None


def check_construction(module: nn.Module, optimizer: Optimizer | None, config: ZeroConfig, comm: DataParallelComm,
                       dtypes: DtypePolicy | None, experts: Set[nn.Parameter],
                       setup_settings: Mapping[str, str]) -> Checked:
    """Refuse, with the fix, what the engine cannot build: first what this rank can tell alone, then (the one
    collective) parameters or settings that differ across ranks."""
    dtypes = checked_dtypes(module, dtypes)
    if comm.collective is not config.collective:
        raise ValueError(f"ZeroConfig(collective={config.collective.value!r}) but the engine's comm was built with "
                         f"collective={comm.collective.value!r}: build it with DataParallelComm(<group>, "
                         "collective=config.collective)")
    if experts and comm.expert_data is None:
        raise ValueError("expert parameters need the expert-data group: build the engine's comm with "
                         "DataParallelComm(..., expert_data=DataParallelComm(<expert-data group>))")
    # an optimizer that averages over the ranks itself once it compresses (1-bit Adam): stage 0 only
    reducing = self_reducing(optimizer, config.stage, comm)
    if reducing is not None and experts:
        raise ValueError(f"{type(optimizer).__name__} with expert parallelism is not built (its compressed "
                         "all-reduce averages every parameter over the whole data group): use AdamW / Adam / SGD")
    if optimizer is not None:
        check_optimizer(optimizer, config.stage, config.elementwise_optimizers)
    names: dict[nn.Parameter, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(p, name)
    groups = trainable_groups(optimizer, names) if optimizer is not None else []
    check_same_structure(names, optimizer, setup_settings, comm)
    return Checked(dtypes, names, groups, reducing)


def checked_dtypes(module: nn.Module, dtypes: DtypePolicy | None) -> DtypePolicy:
    """``dtypes`` (default: the module's dtype, fp32 master), refused when the module is not cast to them."""
    dtypes = dtypes or DtypePolicy(param_dtype=module_dtype(module))
    if dtypes.param_dtype != module_dtype(module):
        raise ValueError(
            f"The module's parameters are {module_dtype(module)} but the dtype policy says "
            f"{dtypes.param_dtype}. Cast the module first (the precision plugin's convert_module does)."
        )
    return dtypes


def check_optimizer(optimizer: Optimizer, stage: int | ZeroStage, extra_allowed: tuple[type, ...] = ()) -> None:
    """Refuse, with the fix, an optimizer whose update is not element-wise under stage >= 1."""
    if not ZeroStage.of(stage).shards_optimizer:
        return
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS or isinstance(optimizer, tuple(extra_allowed)):
        return
    if getattr(optimizer, "_zero_elementwise", False):
        return
    raise ValueError(
        f"ZeRO stage {stage} steps each rank's 1-D shard of the parameters, which is only correct for an "
        f"element-wise optimizer; {type(optimizer).__name__} is not known to be one (LBFGS, Adafactor, "
        "Muon and other optimizers that mix elements of a tensor are not). Use stage 0, an optimizer from "
        f"{[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}, or, if yours is element-wise, pass "
        f"`ZeroStrategy(..., elementwise_optimizers=({type(optimizer).__name__},))`."
    )


def trainable_groups(optimizer: Optimizer, module_params: dict[nn.Parameter, str]) -> list[list[nn.Parameter]]:
    """The trainable module parameters of each param group, in module order.

    Raises when the optimizer holds a tensor that is not a parameter of the module.
    """
    position = {p: i for i, p in enumerate(module_params)}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in position:
                raise ValueError(
                    f"Param group {gi} of {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the LightningModule. Build the optimizer in "
                    "`configure_optimizers` from `self.parameters()` (or a subset of them)."
                )
        trainable = [p for p in group["params"] if p.requires_grad]
        groups.append(sorted(trainable, key=position.__getitem__))
    return groups


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


def open_store(optimizer: Optimizer | None, config: ZeroConfig, dtypes: DtypePolicy, offload: OffloadConfig,
               comm: DataParallelComm, groups: list[list[nn.Parameter]]) -> ShardStore | None:
    """Where this rank's optimizer shards will live (chosen once, before the parameters are partitioned, so that
    stage 3's parameter shards go there unit by unit), or ``None`` when no sharded optimizer is built (see
    :func:`sharded_optimizer`). The swap space is checked from the parameter count first."""
    if optimizer is None or not (config.stage.shards_optimizer or not dtypes.master_is_param_view):
        return None
    params = [p for g in groups for p in g]
    numel = -(-sum(p.numel() for p in params) // comm.world_size) + len(params)  # + padding, at most one per group
    size = {d: torch.empty((), dtype=d).element_size() for d in (dtypes.param_dtype, dtypes.master_dtype,
                                                                  dtypes.grad_accum_dtype)}
    need = swap_bytes_of(offload, numel, size[dtypes.param_dtype], size[dtypes.master_dtype],
                         size[dtypes.grad_accum_dtype], config.stage.shards_parameters)
    return open_shard_store(offload, comm.rank, None, None, dtypes.master_dtype, need)


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
