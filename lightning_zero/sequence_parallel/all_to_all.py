"""The all-to-all around attention: a sequence split swapped for a head split and back, as autograd Functions.

Note [Ulysses all-to-all]
    Every rank of a sequence group of size P holds ``[batch, heads, seq / P, d]``: all heads of its slice
    of the sequence. Before attention, :func:`scatter_heads` sends head chunk ``j`` of its slice to rank
    ``j`` and receives every rank's slice of its own head chunk, so each rank holds
    ``[batch, heads / P, seq, d]``: the whole sequence for ``heads / P`` heads, on which any attention runs
    unchanged (attention mixes positions, never heads). :func:`gather_heads` is the inverse. Each is the
    other's backward: an all-to-all is a permutation of chunks between ranks, and the adjoint of a
    permutation is its inverse. A rank keeps its own chunk, so it sends ``(P - 1) / P`` of the tensor's
    bytes per call; :class:`Traffic` counts exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.core.comm.deferred import strategy_collective


@dataclass
class Traffic:
    """Bytes this rank sent to other ranks of its sequence group, and the number of all-to-alls."""

    bytes_sent: int = 0
    calls: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)

    def record(self, chunk: Tensor, size: int) -> None:
        sent = chunk.element_size() * chunk.numel() // size * (size - 1)
        self.bytes_sent += sent
        self.calls += 1
        key = str(chunk.dtype).removeprefix("torch.")
        self.by_dtype[key] = self.by_dtype.get(key, 0) + sent

    def reset(self) -> None:
        self.bytes_sent, self.calls, self.by_dtype = 0, 0, {}


def _exchange(stacked: Tensor, group: dist.ProcessGroup | None, traffic: Traffic | None) -> Tensor:
    """``all_to_all_single`` along dim 0 of ``stacked`` (one chunk per rank), into a new tensor."""
    size = stacked.shape[0]
    if traffic is not None:
        traffic.record(stacked, size)
    if size == 1:
        return stacked
    out = torch.empty_like(stacked)
    with strategy_collective("sequence-parallel all_to_all"):  # Note [progress record], Note [deferred agreement]
        dist.all_to_all_single(out, stacked, group=group)
    return out


def _seq_to_heads(x: Tensor, size: int, group: Any, traffic: Traffic | None) -> Tensor:
    b, h, s, d = x.shape
    if h % size:
        raise ValueError(f"{h} attention heads do not split over a sequence group of {size}: choose a "
                         "sequence_parallel size that divides the number of heads")
    # [b, h, s, d] -> [P, b, h/P, s, d]: chunk j (heads j*h/P...) goes to rank j
    send = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4).contiguous()
    got = _exchange(send, group, traffic)  # [P, b, h/P, s, d]: chunk i is rank i's slice of the sequence
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _heads_to_seq(x: Tensor, size: int, group: Any, traffic: Traffic | None) -> Tensor:
    b, h, s, d = x.shape
    if s % size:
        raise ValueError(f"a sequence of {s} does not split over a sequence group of {size}")
    # [b, h/P, s, d] -> [P, b, h/P, s/P, d]: sequence slice j goes back to rank j
    send = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _exchange(send, group, traffic)  # [P, b, h/P, s/P, d]: chunk i is rank i's heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, size * h, s // size, d)


class _ScatterHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, size: int, group: Any, traffic: Traffic | None) -> Tensor:
        ctx.size, ctx.group, ctx.traffic = size, group, traffic
        return _seq_to_heads(x, size, group, traffic)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _heads_to_seq(grad.contiguous(), ctx.size, ctx.group, ctx.traffic), None, None, None


class _GatherHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, size: int, group: Any, traffic: Traffic | None) -> Tensor:
        ctx.size, ctx.group, ctx.traffic = size, group, traffic
        return _heads_to_seq(x, size, group, traffic)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _seq_to_heads(grad.contiguous(), ctx.size, ctx.group, ctx.traffic), None, None, None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 without an initialised process group)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def scatter_heads(x: Tensor, group: dist.ProcessGroup | None, traffic: Traffic | None = None) -> Tensor:
    """``[batch, heads, seq / P, d]`` on each of the P ranks of ``group`` -> ``[batch, heads / P, seq, d]``
    (Note [Ulysses all-to-all]); differentiable, its backward is :func:`gather_heads`."""
    return _ScatterHeads.apply(x, group_size(group), group, traffic)


def gather_heads(x: Tensor, group: dist.ProcessGroup | None, traffic: Traffic | None = None) -> Tensor:
    """``[batch, heads / P, seq, d]`` -> ``[batch, heads, seq / P, d]``: the inverse of :func:`scatter_heads`."""
    return _GatherHeads.apply(x, group_size(group), group, traffic)
