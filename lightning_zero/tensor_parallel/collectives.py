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

Every collective of a :class:`TPGroup` is entered through ``strategy_collective``: the hang watchdog sees a rank
waiting in it, and another rank's step error is raised before it (Note [deferred agreement]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.core.comm.data_parallel import collective_device
from lightning_zero.core.comm.deferred import strategy_collective


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

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors: the current GPU on NCCL, else the CPU."""
        return collective_device(self.group)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            with strategy_collective("tensor-parallel all_reduce"):
                dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        with strategy_collective("tensor-parallel all_gather"):
            dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)

    def all_gather_pieces(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's ``tensor`` (one shape on all), in TP rank order, where ``tensor`` is. The collective runs
        on :attr:`device`: after a fit, Lightning's teardown leaves the split module on the CPU, which NCCL refuses."""
        if self.group is None:
            return [tensor]
        local = tensor.detach().contiguous().to(self.device)
        pieces = [torch.empty_like(local) for _ in range(self.size)]
        with strategy_collective("tensor-parallel all_gather"):
            dist.all_gather(pieces, local, group=self.group)
        return [p.to(tensor.device) for p in pieces]

    @torch.no_grad()
    def broadcast_first(self, tensors: list[torch.Tensor]) -> None:
        """TP rank 0's values of ``tensors`` on every rank of the group, in place: one broadcast per dtype, on
        :attr:`device` (every rank passes the same shapes in the same order)."""
        if self.size == 1:
            return
        device, source = self.device, dist.get_global_rank(self.group, 0)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in same])
            with strategy_collective("tensor-parallel broadcast"):
                dist.broadcast(flat, src=source, group=self.group)
            for t, part in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(part.view_as(t))

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
