"""A module's parameters partitioned into flat groups, once, at the engine's construction (:func:`partition_module`):
stage 3's sharded units, one unit whole at a time (:func:`apply_stage3`), or the other stages' whole flat groups.

The units are planned (``units.py``), then each is bound to its flat groups, initialised where it was built
on the meta device (Note [sharded construction] in ``materialize.py``), broadcast from rank 0 and sharded
before the next one is touched. What then drives the units at every step is ``runtime.py``'s
:class:`~lightning_zero.core.stage3.runtime.Stage3Runtime`, which this returns with them. The units are planned
once: activation checkpointing wraps the same ones (any stage).
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass

import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.experts.partition import bind_partitioned
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.core.stage3.materialize import ParamInitFn, initialize_modules
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.sharded_unit import ShardedUnit
from lightning_zero.core.stage3.units import ROOT, UnitPlan, direct_owners, plan_units


@dataclass(frozen=True)
class Partition:
    """What :func:`partition_module` made: stage 3's units and the runtime that drives them (else none), every flat
    group (stage 3 also has groups of frozen parameters), and the undoing of activation checkpointing."""

    units: list[ShardedUnit]
    runtime: Stage3Runtime | None
    all_groups: list[FlatParamGroup]
    undo_checkpointing: Callable[[], None] | None


def partition_module(module: nn.Module, names: dict[nn.Parameter, str], optimizer_groups: list[list[nn.Parameter]],
                     comm: DataParallelComm, config: ZeroConfig, param_init_fn: ParamInitFn | None, init_seed: int,
                     experts: Set[nn.Parameter] = frozenset(),
                     adopt: Callable[[ShardedUnit], None] | None = None) -> Partition:
    """Partition ``module``'s parameters as ``config``'s stage keeps them: stage 3 binds, initialises (meta-built
    models), broadcasts and shards the units one at a time (:func:`apply_stage3`); the other stages bind one flat
    group per optimizer param group, and a second one for the group's ``experts`` (sharded over the expert-data
    group, Note [expert axes] in core/mesh/dims.py) when it holds some. Then rank 0's values everywhere, and
    activation checkpointing of the units when ``config`` asks for it. ``adopt(unit)`` takes each stage 3 unit's
    shards where they live as it is sharded (parameter offload: :func:`apply_stage3`)."""
    plans = unit_plans(module, names, config)
    if config.stage.shards_parameters:
        units, runtime, all_groups = apply_stage3(module, names, optimizer_groups, comm, config, plans,
                                                  param_init_fn, init_seed, experts, adopt)
    else:
        units, runtime = [], None
        all_groups = [g for i, params in enumerate(optimizer_groups)
                      for g in bind_partitioned(params, experts, comm, i, True)]
    with torch.no_grad():  # rank 0's values everywhere, as DDP makes them at construction
        if comm.active:
            for g in all_groups:
                if g.shard is None:  # stage 3 broadcast its units while sharding them
                    comm.of(g.experts).broadcast(g.flat)
            in_flat = {s.param for g in all_groups for s in g.slots}
            for p in names:
                if p not in in_flat:  # expert parameters over their expert-data group (other ranks: other experts)
                    comm.of(p in experts).broadcast(p.data)
            for b in module.buffers():
                comm.broadcast(b)
    undo = (apply_activation_checkpointing([m for plan in plans for m in plan.modules])
            if config.activation_checkpointing else None)
    return Partition(units, runtime, all_groups, undo)


def apply_stage3(
    module: nn.Module,
    names: dict[nn.Parameter, str],
    optimizer_groups: list[list[nn.Parameter]],
    comm: DataParallelComm,
    config: ZeroConfig,
    plans: list[UnitPlan],
    param_init_fn: ParamInitFn | None = None,
    init_seed: int = 0,
    experts: Set[nn.Parameter] = frozenset(),
    adopt: Callable[[ShardedUnit], None] | None = None,
) -> tuple[list[ShardedUnit], Stage3Runtime, list[FlatParamGroup]]:
    """Shard the units of ``plans`` (planned by :func:`unit_plans`) one at a time.

    For each unit: one flat group per optimizer param group present (parameters in no group,
    e.g. frozen ones, get a group with ``optimizer_group == -1``: sharded, never stepped), and one
    more for its ``experts`` among them (sharded over the expert-data group: a unit gathers only
    this rank's experts, Note [expert axes] in core/mesh/dims.py), is bound; parameters built on
    the meta device are initialised in it (Note [sharded construction]); the buffers are
    broadcast from rank 0, this rank's shard is kept and the
    buffer freed. So at most one unit is whole at any time. ``adopt(unit)`` then takes the unit's shards where
    they live (parameter offload: host buffers or swap files), so setup holds at most one shard in memory.

    Returns:
        The units, the runtime whose hooks drive them, and every flat group (unit order).
    """
    group_of = {p: gi for gi, params in enumerate(optimizer_groups) for p in params}
    module_names = {m: n for n, m in module.named_modules()}
    units: list[ShardedUnit] = []
    all_groups: list[FlatParamGroup] = []
    for index, plan in enumerate(plans):
        groups = [fg for gi in [*range(len(optimizer_groups)), -1]
                  for fg in bind_partitioned([p for p in plan.params if group_of.get(p, -1) == gi], experts, comm, gi)]
        owners = direct_owners(module, set(plan.params))
        initialize_modules([(module_names[m], m) for m in owners], param_init_fn, init_seed, set(plan.params))
        for fg in groups:
            comm.of(fg.experts).broadcast(fg.flat)
        unit = ShardedUnit(plan.name, index, groups)
        unit.shard()
        if adopt is not None:
            adopt(unit)
        units.append(unit)
        all_groups.extend(groups)
    root_params = {p for plan in plans if plan.name == ROOT for p in plan.params}
    runtime = Stage3Runtime(
        units,
        [plan.modules for plan in plans],
        direct_owners(module, root_params),
        comm,
        config.prefetch_bucket_size,
        config.max_live_parameters,
        config.max_reuse_distance,
    )
    return units, runtime, all_groups


def unit_plans(module: nn.Module, names: dict[nn.Parameter, str], config: ZeroConfig) -> list[UnitPlan]:
    """The units, planned once: stage 3 shards them (small parameters persistent); activation checkpointing wraps
    their modules; none when neither is on."""
    if config.stage.shards_parameters:
        return plan_units(module, names, config.unit_classes, config.param_persistence_threshold)
    if not config.activation_checkpointing:
        return []
    plans = plan_units(module, names, config.unit_classes)
    if not any(plan.modules for plan in plans):
        raise ValueError(
            f"activation_checkpointing found no unit in {type(module).__name__}: it checkpoints the "
            "children of nn.ModuleLists, or the modules of `unit_classes`. Name the block class in `unit_classes`."
        )
    return plans
