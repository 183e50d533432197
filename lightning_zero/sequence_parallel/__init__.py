"""Sequence parallelism (DeepSpeed-Ulysses): each sequence split over the ranks of a sequence group, an
all-to-all around attention swapping the sequence split for a head split (docs/sequence_parallel.md).

Public pieces: ``scatter_heads`` / ``gather_heads`` (the differentiable all-to-alls, ``all_to_all``),
``SequenceGroup`` (a rank's slice, positions, attention and token-weighted loss, ``group``),
``DistributedAttention`` (any attention wrapped, ``attention``) and ``check_sequence_parallel`` (the refusals,
``checks``). Applied to a module by the strategy in ``lightning_zero/parallel/sequence.py``.
"""

from lightning_zero.sequence_parallel.all_to_all import Traffic, gather_heads, scatter_heads
from lightning_zero.sequence_parallel.attention import DistributedAttention
from lightning_zero.sequence_parallel.checks import check_sequence_parallel
from lightning_zero.sequence_parallel.group import SequenceGroup

__all__ = ["DistributedAttention", "SequenceGroup", "Traffic",
           "check_sequence_parallel", "gather_heads", "scatter_heads"]
