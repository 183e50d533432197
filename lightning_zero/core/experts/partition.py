"""The flat groups of one set of parameters, split by partition: the dense ones over ZeRO's data group, the experts'
over their expert-data group (Note [expert axes] in core/mesh/dims.py), each bound (its parameters views of it)."""

from __future__ import annotations

from collections.abc import Set

from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import FlatParamGroup


def bind_partitioned(params: list[nn.Parameter], experts: Set[nn.Parameter], comm: DataParallelComm,
                     optimizer_group: int, keep_empty: bool = False) -> list[FlatParamGroup]:
    """The bound flat groups of ``params`` (module order): the dense ones' (kept empty with ``keep_empty``), then
    the experts' when there are some, each sharded over its partition's group (``comm.of``)."""
    out = []
    for part in (False, True):
        members = [p for p in params if (p in experts) == part]
        if not members and (part or not keep_empty):
            continue
        c = comm.of(part)
        g = FlatParamGroup(members, c.world_size, c.rank, experts=part)
        g.optimizer_group = optimizer_group
        g.bind()
        out.append(g)
    return out
