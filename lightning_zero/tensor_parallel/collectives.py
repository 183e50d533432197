"""The four conjugate autograd functions of Megatron-style tensor parallelism, over one TP group.

Note [conjugate functions]
    A column-parallel layer takes a replicated input and produces a split output; a row-parallel layer
    takes a split input and produces partial sums. Four functions move activations between the two
    layouts, each the other's transpose in backward:

    ============================  ======================  ===========================
    function                      forward                 backward
    ============================  ======================  ===========================
    ``copy_to_tp`` (Megatron f)   identity                all-reduce (sum)
    ``reduce_from_tp`` (g)        all-reduce (sum)        identity
    ``gather_from_tp``            all-gather (last dim)   keep this rank's slice
    ``scatter_to_tp``             keep this rank's slice  all-gather (last dim)
    ============================  ======================  ===========================

    ``copy_to_tp`` sits where a replicated activation enters a split region: every rank's share of
    the input gradient is a partial sum, and the all-reduce makes it the whole gradient on every rank,
    so everything before it (layer norms, embeddings) gets the same gradient on every TP rank and
    needs no further reduction. Every function is the identity when the group spans one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group: ``size`` ranks, this one at ``rank``; ``group`` is ``None`` in one
    process (then ``size`` must be 1 and every collective is a no-op)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"a tensor-parallel rank {self.rank} of {self.size} does not exist")
        if self.group is None and self.size > 1:
            raise ValueError(f"a tensor-parallel group of {self.size} ranks needs a process group")

    @classmethod
    def single(cls) -> TPGroup:
        return cls(None, 1, 0)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)

    def slice_last(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        width = tensor.size(-1)
        if width % self.size:
            raise ValueError(f"a last dimension of {width} does not split over {self.size} tensor-parallel ranks")
        step = width // self.size
        return tensor[..., self.rank * step : (self.rank + 1) * step].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return tp.all_gather_last(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.slice_last(grad), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return tp.slice_last(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_gather_last(grad), None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward (Note [conjugate functions])."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather along the last dimension; backward keeps this rank's slice."""
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)


def scatter_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of the last dimension; backward all-gathers."""
    return x if tp.size == 1 else _ScatterToTP.apply(x, tp)
