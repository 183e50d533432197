"""``SequenceGroup``: one rank's share of a sequence split over its sequence group, and what a model needs
of it: its slice of a batch, the global positions of that slice, the attention through the all-to-alls
and the token-weighted loss over the whole sequence.

Note [token-weighted loss over data x sequence]
    Each rank of a sequence group of P ranks holds ``n_r`` of the sample's labelled tokens. The loss it
    returns is ``L = (sum over the group of the local sums) / (sum over the group of n_r)``: the unsplit
    run's mean over the whole sequence, the same value on every rank of the group (the forward sums the
    pair ``(local sum, n_r)`` with one all-reduce). The backward of that all-reduce is the all-reduce of
    the incoming gradients, its true adjoint: every rank backpropagates the same L with the same seed, so
    each local sum receives ``P / N`` (N = the global count), and each rank's parameter gradient is its
    share of ``P * dL/dw`` (the all-to-alls' backward carry the other ranks' shares of the activations'
    gradients to where they were computed). ZeRO then averages the gradients over data x sequence, i.e.
    divides their sum by ``D * P``: ``(1 / (D P)) * sum_d P * dL_d/dw = (1 / D) * sum_d dL_d/dw``, the
    gradient of the D data-parallel replicas of the unsplit run, whatever the padding (labels of
    ``ignore_index``) of each slice.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_zero.core.comm.deferred import strategy_collective
from lightning_zero.sequence_parallel.all_to_all import Traffic, gather_heads, group_size, scatter_heads
from lightning_zero.tensor_parallel.rng import SEQUENCE_SEED_OFFSET, SplitRegionRNG

IGNORE_INDEX = -100


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum whose backward is the all-reduce sum of the gradients (Note [token-weighted loss ...])."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _summed(grad, ctx.group), None


def _summed(x: Tensor, group: Any) -> Tensor:
    """A copy of ``x`` summed over ``group`` (recorded for the hang watchdog)."""
    out = x.clone()
    with strategy_collective("sequence-parallel all_reduce (loss)"):
        dist.all_reduce(out, group=group)
    return out


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's place in its sequence group.

    Args:
        group: the process group of the sequence dimension (``None``: one process, size 1).
        size: its ranks (``P``).
        rank: this rank's index in it: which contiguous slice of each sequence it holds.
        traffic: the bytes the all-to-alls sent (:class:`~lightning_zero.sequence_parallel.all_to_all.Traffic`).
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    traffic: Traffic = field(default_factory=Traffic, compare=False)
    _sliced: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a sequence group of {self.size}")

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> SequenceGroup:
        """This rank's view of ``group`` (its size and this rank's index in it)."""
        size = group_size(group)
        return cls(group, size, dist.get_rank(group) if size > 1 else 0)

    # ------------------------------------------------------------------ the data
    def local_length(self, length: int) -> int:
        """Tokens of a ``length``-token sequence this rank holds; refuses one that does not split evenly."""
        if length % self.size:
            raise ValueError(f"a sequence of {length} tokens does not split over a sequence group of {self.size}: "
                             f"use a length that is a multiple of {self.size} (data.seq_len / model.seq_len)")
        return length // self.size

    def slice(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's contiguous slice of ``t`` along its sequence dimension ``dim``."""
        n = self.local_length(t.size(dim))
        return t.narrow(dim, self.rank * n, n)

    def positions(self, local_length: int, device: torch.device | str | None = None) -> Tensor:
        """The position ids of this rank's slice within the whole sequence."""
        start = self.rank * local_length
        return torch.arange(start, start + local_length, device=device)

    # ------------------------------------------------------------------ attention
    def attention(self, q: Tensor, k: Tensor, v: Tensor, local_attention: Callable[..., Tensor],
                  *args: Any, **kwargs: Any) -> Tensor:
        """``local_attention`` over the whole sequence for ``heads / P`` heads (Note [Ulysses all-to-all]):
        q, k, v ``[batch, heads, seq / P, d]`` in, the output in the same shape; q, k and v travel in one
        all-to-all."""
        if self.size == 1:
            return local_attention(q, k, v, *args, **kwargs)
        b = q.size(0)
        if q.shape == k.shape == v.shape:
            q, k, v = scatter_heads(torch.cat((q, k, v)), self.group, self.traffic).split(b)
        else:
            q, k, v = (scatter_heads(z, self.group, self.traffic) for z in (q, k, v))
        with self.dropout_stream(q.device):  # this rank's heads: its own attention dropout masks
            out = local_attention(q, k, v, *args, **kwargs)
        return gather_heads(out, self.group, self.traffic)

    def dropout_stream(self, device: torch.device) -> Any:
        """``with group.dropout_stream(x.device):`` around computation on this rank's split activations (its
        tokens, or after the all-to-all its heads): dropout draws this rank's masks, independent of the other
        ranks', from a stream derived from the default one, so activation checkpointing recomputes them
        exactly (Note [dropout streams] in tensor_parallel/rng.py). No change on one rank."""
        return nullcontext() if self.size == 1 else SplitRegionRNG(self.rank, SEQUENCE_SEED_OFFSET).fork(device)

    def local_heads(self, sparse: Any) -> Any:
        """A :class:`~lightning_zero.sparse_attention.SparseSelfAttention` over this rank's heads after the
        all-to-all: ``heads / P`` heads with their own layouts (a layout may differ per head). Cached."""
        if self.size == 1 or sparse is None:
            return sparse
        key = id(sparse)
        if key not in self._sliced:
            heads = sparse.sparsity_config.num_heads
            if heads % self.size:
                raise ValueError(f"the sparsity config has {heads} heads, which do not split over a sequence group "
                                 f"of {self.size}")
            n = heads // self.size
            local = sparse.narrowed_to_heads(self.rank * n, (self.rank + 1) * n)
            self._sliced[key] = (sparse, local)  # the original is kept alive: its id stays unique
        return self._sliced[key][1]

    # ------------------------------------------------------------------ the loss
    def loss(self, logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
        """Next-token cross-entropy of this rank's slice as the token-weighted mean over the whole sequence
        (Note [token-weighted loss over data x sequence]); the same value on every rank of the group."""
        flat = targets.reshape(-1)
        local = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, ignore_index=ignore_index,
                                reduction="sum")
        if self.size == 1:
            return local / (flat != ignore_index).sum().clamp(min=1)
        count = (flat != ignore_index).sum().to(local.dtype)
        total = _SumOverGroup.apply(torch.stack((local, count)), self.group)
        return total[0] / total[1].detach().clamp(min=1)
