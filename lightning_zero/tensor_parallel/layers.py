"""The tensor-parallel layers: column- and row-parallel ``Linear`` and the vocabulary-parallel ``Embedding``, holding
plain tensors, each tagged with its split dimension.

Note [split tags]
    A parameter split across the tensor-parallel ranks carries ``tp_split_dim`` (the dimension of the
    unsplit weight it was cut along) and ``tp_chunks`` (how many fused blocks, e.g. 3 for a fused
    q/k/v projection, each cut separately so that whole heads stay together); a replicated parameter
    has no tag. The tag (``SplitTag``, written by ``tag_split``, read by ``split_of``) is defined beside the
    checkpoint's slice references in ``checkpoint/slices.py``, which reads it too and sits below this folder.
    The tags are ordinary attributes of a plain ``nn.Parameter``: ZeRO's flat buffers lay
    out the local slices like any other tensor, and the gradient norm counts an untagged parameter
    once over its TP group (``parallel/tensor.py``, Note [norm over tensor x data]).

Layers are built from an existing, initialised ``nn.Linear`` (``nn.Embedding``) by slicing its weights
(:func:`slice_param`), so one seed gives the same model whatever the tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.checkpoint.slices import SplitTag, tag_split
from lightning_zero.tensor_parallel.collectives import (
    TPGroup,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)

# id(whole param) -> (the whole param, kept alive so that its id is not reused; (dim, chunks); its slice)
SliceMemo = dict[int, tuple[nn.Parameter, tuple[int, int], nn.Parameter]]


def slice_tensor(whole: torch.Tensor, tag: SplitTag) -> torch.Tensor:
    """``tag.rank``'s slice of an unsplit tensor (a copy), cut as :func:`slice_param` cuts a parameter."""
    part = whole.size(tag.dim) // (tag.chunks * tag.size)
    blocks = whole.chunk(tag.chunks, dim=tag.dim)
    return torch.cat([b.narrow(tag.dim, tag.rank * part, part) for b in blocks], dim=tag.dim).clone()


def unslice_tensors(parts: list[torch.Tensor], dim: int, chunks: int) -> torch.Tensor:
    """The unsplit tensor from every rank's slice, in rank order (the inverse of :func:`slice_tensor`)."""
    blocks = [p.chunk(chunks, dim=dim) for p in parts]
    return torch.cat([b[c] for c in range(chunks) for b in blocks], dim=dim)


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` holds its own values: not a storage-less placeholder (another pipeline stage's weight, one
    element expanded to its shape)."""
    return t.numel() == 0 or t.untyped_storage().nbytes() >= t.numel() * t.element_size()


def slice_local(t: torch.Tensor, dim: int, chunks: int, tp: TPGroup) -> torch.Tensor:
    """This rank's part of ``t`` along ``dim``: ``chunks`` equal blocks, each cut into ``tp.size`` parts and
    this rank's parts concatenated (a new tensor). A placeholder is cut into a placeholder (no storage)."""
    part = t.size(dim) // (chunks * tp.size)
    if not has_storage(t):
        shape = list(t.shape)
        shape[dim] = part * chunks
        return torch.full((), float("nan"), dtype=t.dtype, device=t.device).expand(shape)
    with torch.no_grad():
        blocks = t.detach().chunk(chunks, dim=dim)
        # one copy: torch.cat always returns new storage (a clone after it held a second slice-sized copy at the
        # moment the whole weight is still alive: tests/distributed/test_tensor_parallel_memory.py's memory limit)
        return torch.cat([b.narrow(dim, tp.rank * part, part) for b in blocks], dim=dim)


def slice_param(param: nn.Parameter, dim: int, chunks: int, tp: TPGroup, memo: SliceMemo, name: str) -> nn.Parameter:
    """This rank's slice of ``param`` along ``dim``: ``chunks`` equal blocks, each cut into ``tp.size`` parts.

    A parameter shared by two modules (tied weights) is sliced once; both get the same new parameter,
    provided both cut it the same way.

    Raises:
        ValueError: the dimension does not divide, or a tied parameter is cut two different ways.
    """
    key = (dim, chunks)
    if id(param) in memo:
        _, seen, sliced = memo[id(param)]
        if seen != key:
            raise ValueError(f"{name} is tied to a parameter split as (dim, chunks) {seen}, here {key}: a tied "
                             "weight must be split the same way by both modules (e.g. a vocabulary-parallel "
                             "embedding with a 'colwise' head), or untie it")
        return sliced
    size = param.size(dim)
    if size % (chunks * tp.size):
        raise ValueError(f"{name}: dimension {dim} of size {size} does not split into {chunks} block(s) x "
                         f"{tp.size} tensor-parallel ranks: choose a tensor-parallel size dividing {size // chunks}")
    out = nn.Parameter(slice_local(param, dim, chunks, tp), requires_grad=param.requires_grad)
    tag_split(out, SplitTag(dim, chunks, tp.size, tp.rank))
    memo[id(param)] = (param, key, out)
    return out


def _replicated(param: nn.Parameter | None, memo: SliceMemo) -> nn.Parameter | None:
    if param is None:
        return None
    if id(param) in memo:
        raise ValueError("a replicated bias is tied to a split parameter: untie it")
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split along its output features: a replicated input, a split output
    (or the whole output with ``gather_output``). ``chunks`` > 1: the output is ``chunks`` fused blocks
    (q, k, v) and each rank holds its part of every block, in block order."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, memo: SliceMemo, name: str, chunks: int = 1,
                 gather_output: bool = False) -> None:
        super().__init__()
        if gather_output and chunks > 1:
            raise ValueError(f"{name}: gathering the output of a fused ({chunks}-block) column-parallel layer "
                             "would interleave its blocks: keep its output split (the next layer 'rowwise')")
        self.tp, self.chunks, self.gather_output = tp, chunks, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features // tp.size
        self.weight = slice_param(linear.weight, 0, chunks, tp, memo, f"{name}.weight")
        self.bias = (slice_param(linear.bias, 0, chunks, tp, memo, f"{name}.bias")
                     if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        whole = self.out_features * self.tp.size
        return (f"in_features={self.in_features}, out_features={self.out_features} (of {whole})"
                f", chunks={self.chunks}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split along its input features: a split input (or, with
    ``input_is_parallel=False``, a replicated one that each rank slices), partial products summed over
    the group, the bias (replicated) added once after the sum."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, memo: SliceMemo, name: str,
                 input_is_parallel: bool = True) -> None:
        super().__init__()
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.in_features, self.out_features = linear.in_features // tp.size, linear.out_features
        self.weight = slice_param(linear.weight, 1, 1, tp, memo, f"{name}.weight")
        self.bias = _replicated(linear.bias, memo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp)
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.in_features * self.tp.size}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


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
