"""The experts' partition of ZeRO's state: expert parameters partitioned over their expert-data group, beside the
rest over the data group (Note [expert axes] in core/mesh/dims.py; docs/expert_parallel.md).

``partition`` (a set of parameters' flat groups, one per partition). Their gradients are reduced per partition by
``core/zero/partitioned_reducer.py`` (above this folder in core/'s order: it extends ZeRO's reducer).
"""

from lightning_zero.core.experts.partition import bind_partitioned

__all__ = ["bind_partitioned"]
