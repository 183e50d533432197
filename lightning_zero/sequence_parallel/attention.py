"""``DistributedAttention``: any attention callable run over the whole sequence of a sequence-split batch
(DeepSpeed-Ulysses' wrapper): the all-to-alls of Note [Ulysses all-to-all] around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_zero.sequence_parallel.group import SequenceGroup
from lightning_zero.sparse_attention import SparseSelfAttention


class DistributedAttention(nn.Module):
    """Wraps ``local_attention(q, k, v, *args, **kwargs)`` (dense SDPA, a
    :class:`~lightning_zero.sparse_attention.SparseSelfAttention`, ...) for inputs split along the sequence.

    Args:
        local_attention: attention over ``[batch, heads / P, seq, d]``; a ``SparseSelfAttention`` made for all
            heads is narrowed to this rank's heads (their layouts) automatically.
        sequence_group: this rank's :class:`SequenceGroup`.

    ``forward(q, k, v, ...)`` takes ``[batch, heads, seq / P, d]`` (this rank's slice of the sequence) and
    returns the attention output of that slice in the same shape; extra arguments go to ``local_attention``
    (they must describe the whole sequence, e.g. an ``attn_mask`` of ``seq x seq``).
    """

    def __init__(self, local_attention: Callable[..., Tensor], sequence_group: SequenceGroup) -> None:
        super().__init__()
        self.local_attention = local_attention
        self.sequence_group = sequence_group

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        attention = self.local_attention
        if isinstance(attention, SparseSelfAttention):
            attention = self.sequence_group.local_heads(attention)
        return self.sequence_group.attention(q, k, v, attention, *args, **kwargs)
