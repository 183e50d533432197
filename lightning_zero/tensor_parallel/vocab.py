"""Vocabulary-parallel embedding and cross-entropy: each tensor-parallel rank holds a contiguous range
of the vocabulary's rows, and neither the whole embedding nor the whole logits exist on one rank.

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
from torch import nn

from lightning_zero.tensor_parallel.collectives import TPGroup, reduce_from_tp
from lightning_zero.tensor_parallel.layers import SliceMemo, slice_param


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows (the vocabulary) are split: each rank looks up the ids it owns,
    zeros the others, and the partial embeddings are summed over the group (Megatron's g)."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup, memo: SliceMemo, name: str) -> None:
        super().__init__()
        settings = ("max_norm", "scale_grad_by_freq", "sparse")
        refused = {k: getattr(embedding, k) for k in settings if getattr(embedding, k)}
        if refused:
            given = ", ".join(f"{k}={v!r}" for k, v in refused.items())
            raise ValueError(f"{name}: a vocabulary-parallel embedding with {given} is not built (max_norm "
                             "renormalises rows in place, scale_grad_by_freq counts ids per rank and sparse gradients "
                             "do not go into ZeRO's flat buffers). Fix: drop them from the nn.Embedding, or leave "
                             f"{name!r} out of the tensor-parallel plan (it stays whole on every rank)")
        self.tp, self.padding_idx = tp, embedding.padding_idx  # nn.Embedding made a negative one positive
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = slice_param(embedding.weight, 0, 1, tp, memo, f"{name}.weight")
        self.start = tp.rank * self.weight.size(0)
        local_pad = None if self.padding_idx is None else self.padding_idx - self.start
        # the padding row gets no gradient on the rank holding it (its index among this rank's rows)
        self.local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.weight.size(0) else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.local_padding_idx)
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)

    def extra_repr(self) -> str:
        end = self.start + self.weight.size(0)
        return f"rows {self.start}..{end} of {self.num_embeddings}, dim {self.embedding_dim}"


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
