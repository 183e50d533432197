"""Stage 3's setup: a module becomes sharded units, one unit whole at a time (:func:`apply_stage3`).

The units are planned (``units.py``), then each is bound to its flat groups, initialised where it was built
on the meta device (Note [sharded construction] in ``materialize.py``), broadcast from rank 0 and sharded
before the next one is touched. What then drives the units at every step is ``runtime.py``'s
:class:`~lightning_zero.core.stage3.runtime.Stage3Runtime`, which this returns with them.
"""

from __future__ import annotations

from collections.abc import Set

from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.experts.partition import bind_partitioned
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.core.stage3.materialize import ParamInitFn, initialize_modules
from lightning_zero.core.stage3.runtime import Stage3Runtime
from lightning_zero.core.stage3.sharded_unit import ShardedUnit
from lightning_zero.core.stage3.units import ROOT, direct_owners, plan_units


def apply_stage3(
    module: nn.Module,
    names: dict[nn.Parameter, str],
    optimizer_groups: list[list[nn.Parameter]],
    comm: DataParallelComm,
    config: ZeroConfig,
    param_init_fn: ParamInitFn | None = None,
    init_seed: int = 0,
    experts: Set[nn.Parameter] = frozenset(),
) -> tuple[list[ShardedUnit], Stage3Runtime, list[FlatParamGroup]]:
    """Plan the units of ``module`` and shard them one at a time.

    For each unit: one flat group per optimizer param group present (parameters in no group,
    e.g. frozen ones, get a group with ``optimizer_group == -1``: sharded, never stepped), and one
    more for its ``experts`` among them (sharded over the expert-data group: a unit gathers only
    this rank's experts, Note [expert axes] in core/mesh/dims.py), is bound; parameters built on
    the meta device are initialised in it (Note [sharded construction]); the buffers are
    broadcast from rank 0, this rank's shard is kept and the
    buffer freed. So at most one unit is whole at any time.

    Returns:
        The units, the runtime whose hooks drive them, and every flat group (unit order).
    """
    group_of = {p: gi for gi, params in enumerate(optimizer_groups) for p in params}
    plans = plan_units(module, names, config.unit_classes, config.param_persistence_threshold)
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
