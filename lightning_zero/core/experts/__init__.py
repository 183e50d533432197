"""The experts' partition of ZeRO's state: expert parameters reduced and partitioned over their expert-data group,
beside the rest over the data group (Note [expert axes] in core/mesh/dims.py; docs/expert_parallel.md).

``partition`` (a set of parameters' flat groups, one per partition), ``reducers`` (``PartitionedReducer``: one
gradient reducer per partition behind the reducer's interface).
"""

from lightning_zero.core.experts.partition import bind_partitioned
from lightning_zero.core.experts.reducers import PartitionedReducer, make_reducer

__all__ = ["PartitionedReducer", "bind_partitioned", "make_reducer"]
