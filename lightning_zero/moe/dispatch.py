"""Tokens to their experts and back: the expert-parallel all-to-alls, with uneven splits, as autograd functions.

Note [expert dispatch]
    One MoE layer's call on one rank, T tokens routed to k experts each (the kept assignments, A of them):

    1. the assignments are sorted by expert (stable: token order within an expert), their rows gathered;
    2. without expert parallelism the local experts compute on the sorted rows (one grouped product each);
    3. with an expert-parallel group of P ranks, each holding L = E / P consecutive experts (rank p: experts
       p*L .. p*L + L - 1), the counts go first: one ``all_to_all_single`` of E integers tells every rank how
       many rows each peer sends to each of its L experts; then the rows: one ``all_to_all_single`` with
       uneven splits (rank p's rows, in expert order, to the rank holding them). The received rows, grouped
       by source rank, are reordered expert by expert, computed, put back, and returned by the reverse
       all-to-all (the splits swapped);
    4. each assignment's output is weighted and added to its token's row (``index_add``).

    Backward runs the two row exchanges' conjugates (an all-to-all with the splits swapped), in the reverse
    order. Every rank calls every exchange of every MoE call, in the same order, whatever its routing: a rank
    that sends or receives no row still takes part with an empty split (an empty send is still a send), so a
    starved expert never leaves a rank waiting (no hang: tests/distributed/test_moe.py starves one).
    The counts are the only host synchronisation (the splits must be known on the host). Each exchange is
    entered through ``strategy_collective``: the hang watchdog names a rank waiting in it, and another rank's
    step error is settled first.

Note [all-to-all bytes]
    ``ExpertGroup.bytes_sent`` counts what this rank sends to other ranks (its own rows stay): per call the
    counts (E - L integers), its rows bound for other ranks' experts (dispatch) and the results of the rows
    other ranks sent it (combine), and the same two again in backward. With A assignments per rank spread
    uniformly over the experts that is ``4 * A * (P - 1) / P * H * bytes`` per layer and micro-step;
    ``estimator`` and the benchmark compare with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.core.comm.deferred import strategy_collective

Compute = Callable[[torch.Tensor, list[int]], torch.Tensor]  # (rows sorted by local expert, counts) -> rows


class ExpertGroup:
    """The ranks one MoE layer's experts are split over (``size`` 1: every expert local).

    Args:
        group: the expert-parallel process group (``None`` with ``size`` 1).
        size: P, its ranks.
        rank: this rank's index in it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, size: int = 1, rank: int = 0) -> None:
        if size > 1 and group is None:
            raise ValueError("an expert-parallel group of several ranks needs its process group")
        self.group, self.size, self.rank = group, size, rank
        self.bytes_sent = 0  # Note [all-to-all bytes]
        self.exchanges = 0  # row exchanges issued (forward and backward)

    def local_experts(self, num_experts: int) -> range:
        """The global indices of this rank's experts."""
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split over expert_parallel={self.size} ranks: choose an "
                             f"expert-parallel size dividing {num_experts}")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def _count(self, nbytes: int) -> None:
        self.bytes_sent += nbytes


class _Exchange(torch.autograd.Function):
    """Rows to peers with uneven splits; backward sends the gradients back the same way, splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, receive: list[int], send: list[int], ep: ExpertGroup) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.ep = receive, send, ep
        return _all_to_all(x, receive, send, ep)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad.contiguous(), ctx.send, ctx.receive, ctx.ep), None, None, None


def _all_to_all(x: torch.Tensor, receive: list[int], send: list[int], ep: ExpertGroup) -> torch.Tensor:
    out = x.new_empty(sum(receive), *x.shape[1:])
    with strategy_collective("expert-parallel all_to_all"):  # Note [progress record], Note [deferred agreement]
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=ep.group)
    row = math.prod(x.shape[1:]) * x.element_size()
    ep._count((sum(send) - send[ep.rank]) * row)
    ep.exchanges += 1
    return out


def exchange_counts(counts: torch.Tensor, ep: ExpertGroup) -> torch.Tensor:
    """[P, L]: how many rows each rank of the group sends to each of this rank's L experts (``counts``: [E], the
    rows this rank sends to every expert, in expert order)."""
    received = torch.empty_like(counts)
    with strategy_collective("expert-parallel all_to_all (counts)"):
        dist.all_to_all_single(received, counts, group=ep.group)
    per = counts.numel() // ep.size
    ep._count((counts.numel() - per) * counts.element_size())
    return received.view(ep.size, per)


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """The permutation taking rows grouped by source rank (then expert) to rows grouped by expert (then source
    rank); ``received`` [P, L] the counts."""
    starts = (torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)).view_as(received)
    lengths = received.t().reshape(-1)
    firsts = starts.t().reshape(-1)
    total = int(lengths.sum())
    within = torch.arange(total, device=received.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.repeat_interleave(firsts, lengths) + within


def dispatch_and_combine(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor | None,
                         num_experts: int, compute: Compute, ep: ExpertGroup | None = None) -> torch.Tensor:
    """Every token's weighted sum of its experts' outputs (Note [expert dispatch]).

    Args:
        x: [T, H] tokens.
        experts, weights: [T, k] the chosen experts (global indices) and their weights.
        kept: [T, k] the assignments a capacity kept (``None``: all).
        num_experts: E.
        compute: this rank's experts on rows sorted by local expert, given the rows per local expert.
        ep: the expert-parallel group (``None`` or size 1: every expert is local).
    """
    tokens, k = experts.shape
    chosen = experts.reshape(-1)
    token = torch.arange(tokens, device=x.device).repeat_interleave(k)
    weight = weights.reshape(-1)
    if kept is not None and not bool(kept.all()):
        keep = kept.reshape(-1).nonzero().squeeze(1)
        chosen, token, weight = chosen[keep], token[keep], weight[keep]
    order = torch.argsort(chosen, stable=True)
    chosen, token, weight = chosen[order], token[order], weight[order]
    counts = torch.bincount(chosen, minlength=num_experts)
    rows = x.index_select(0, token)
    if ep is None or ep.size == 1:
        out = compute(rows, counts.tolist())
    else:
        out = _across_ranks(rows, counts, compute, ep)
    return torch.zeros_like(x).index_add(0, token, out * weight.unsqueeze(1).to(out.dtype))


def _across_ranks(rows: torch.Tensor, counts: torch.Tensor, compute: Compute, ep: ExpertGroup) -> torch.Tensor:
    """Steps 3 of Note [expert dispatch]: rows to the ranks of their experts, computed there, and back."""
    received = exchange_counts(counts, ep)  # [P, L]
    send = counts.view(ep.size, -1).sum(dim=1).tolist()
    receive = received.sum(dim=1).tolist()
    arrived = _Exchange.apply(rows, receive, send, ep)
    perm = expert_major(received)
    computed = compute(arrived.index_select(0, perm), received.sum(dim=0).tolist())
    back = torch.empty_like(perm).index_copy_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return _Exchange.apply(computed.index_select(0, back), send, receive, ep)
