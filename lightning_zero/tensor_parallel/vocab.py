"""Vocabulary-parallel cross-entropy: each tensor-parallel rank holds a contiguous range of the vocabulary's
logits (a 'colwise' head), and the whole logits never exist on one rank (the vocabulary-parallel embedding is
``layers.py``'s).

Note [vocabulary-parallel cross-entropy]
    With logits split along the vocabulary (a 'colwise' head), the loss is the unsplit one computed
    with three all-reduces of per-token scalars: the maximum logit (MAX, for stability), the sum of
    ``exp(logit - max)`` (SUM) and the target's logit (SUM: only its owner contributes it). Backward
    is local: ``softmax - one_hot(target)`` on this rank's columns, times the incoming gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero.tensor_parallel.collectives import TPGroup


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup, ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        width = logits.size(-1)
        start = tp.rank * width
        peak = tp.all_reduce(logits.max(dim=-1).values.clone(), dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = tp.all_reduce(exp.sum(dim=-1))
        local = targets - start
        mine = (local >= 0) & (local < width)
        index = local.masked_fill(~mine, 0).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
        picked = tp.all_reduce(picked)
        loss = total.log() - picked
        valid = targets != ignore_index
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine & valid, valid)
        return loss.masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, hit, valid = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, index, -hit.to(out.dtype).unsqueeze(-1))
        out *= (grad * valid).unsqueeze(-1)
        return out, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` split along the vocabulary (this rank's contiguous columns) against
    whole-vocabulary ``targets``; the same value on every TP rank (Note [vocabulary-parallel cross-entropy])."""
    if tp.size == 1:
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=ignore_index)
    flat = logits.reshape(-1, logits.size(-1))
    t = targets.reshape(-1)
    losses = _VocabParallelCE.apply(flat, t, tp, ignore_index)
    count = (t != ignore_index).sum().clamp(min=1)
    return losses.sum() / count
