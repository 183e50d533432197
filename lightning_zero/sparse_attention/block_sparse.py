"""The pure-torch block-sparse attention kernel: exact, trainable on any device, memory linear in length.

Each query block gathers the key / value blocks its layout row attends to, multiplies, and takes the
softmax over the gathered blocks only. Query blocks are processed in chunks (Note [chunked rows]) by
a custom autograd Function whose backward recomputes each chunk's probabilities from the saved
log-sum-exp, the way flash attention does, instead of keeping them.

Note [chunked rows]: a chunk is a run of consecutive query-block rows; its gathered width is the most
blocks any of its rows (over all heads) attends to, so a fixed layout, whose rows grow with their
index, wastes little. The chunk's rows are cut so that its score tensor stays under
``chunk_elements`` elements: peak memory is the inputs, the output, one chunk's scores and the
gradients, whatever the sequence length.

Note [exactness]: padded slots of a row (blocks it does not attend to) get a score of -inf, so they
take no probability and no gradient; with the masks applied as DeepSpeed applies them (``add``: the
mask is added to the scaled score; ``mul``: a zero in the mask means -inf) the result is dense
attention with the layout as its mask. Matmuls run in the input dtype, the softmax in float32 (or
float64), and the key / value gradients accumulate in float32 for 16-bit inputs.

Note [hidden rows]: a query whose every key is hidden (a left-padded position under a causal mask, as a
Hugging Face model pads a batch for generation) has only -inf scores. Its softmax would be 0 / 0 (NaN,
which then reaches every logit through the next layers); like SDPA, the row-group executor and
FlexAttention, its output is 0 instead: its maximum is taken as 0 and its sum as 1 (any other row's sum
is >= 1, its maximum's own term being exp(0)), so its probabilities are 0 and its log-sum-exp 0, and the
backward, which recomputes them from that log-sum-exp, gives it no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 22  # scores of one chunk: 4M elements (16 MiB in float32)


@dataclass(frozen=True)
class RowChunk:
    """Query-block rows ``[start, stop)``: per head and row the key blocks attended (``index``,
    padded with block 0) and the slots whose whole block is hidden (``hidden``: padding, or a block
    after the row when causal), both ``[heads, rows, width]``; ``diagonal``: (head, row, slot) of the
    slots holding the row's own block, which causal attention hides above the diagonal."""

    start: int
    stop: int
    index: torch.Tensor
    hidden: torch.Tensor
    diagonal: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def row_chunks(layout: torch.Tensor, block: int, batch_heads: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
               causal: bool = False) -> list[RowChunk]:
    """Cut a ``(heads, blocks, blocks)`` layout into :class:`RowChunk` s (Note [chunked rows]).
    ``batch_heads`` (batch x heads) sizes the chunks' score tensors."""
    layout = layout.bool()
    counts = layout.sum(-1).amax(0)  # per row: the widest head
    if int(counts.min()) == 0:
        row = int((counts == 0).nonzero()[0])
        raise ValueError(f"row {row} of the layout attends to no block: its softmax would be empty (nan)")
    # columns a row attends to first, in increasing order: a stable sort of "not attended"
    order = torch.sort((~layout).to(torch.int8), dim=-1, stable=True).indices
    chunks, start, n = [], 0, layout.shape[1]
    while start < n:
        stop, width = start + 1, int(counts[start])
        while stop < n:
            grown = max(width, int(counts[stop]))
            if batch_heads * (stop + 1 - start) * block * block * grown > chunk_elements:
                break
            stop, width = stop + 1, grown
        index = order[:, start:stop, :width]
        hidden = ~torch.gather(layout[:, start:stop], 2, index)
        diagonal = None
        if causal:
            rows = torch.arange(start, stop, device=layout.device)[None, :, None]
            hidden = hidden | (index > rows)
            diagonal = tuple((~hidden & (index == rows)).nonzero(as_tuple=True))
        chunks.append(RowChunk(start, stop, torch.where(hidden, 0, index), hidden, diagonal))
        start = stop
    return chunks


def _gather_pairs(x: torch.Tensor, chunk: RowChunk, block: int, heads: int) -> torch.Tensor:
    """Entries ``[..., query, key]`` of a dense ``(b, h, L, L)`` tensor (``b``, ``h`` possibly 1) for the
    chunk's query rows and gathered key blocks: ``(b, heads, rows, block, width * block)``."""
    b, h, length, _ = x.shape
    n = length // block
    xb = x.reshape(b, h, n, block, n, block)[:, :, chunk.start:chunk.stop].transpose(3, 4)  # b h r n bq bk
    hsel = torch.arange(heads, device=x.device) if h == heads else torch.zeros(heads, dtype=torch.long,
                                                                                   device=x.device)
    rows = torch.arange(chunk.stop - chunk.start, device=x.device)
    picked = xb[:, hsel[:, None, None], rows[None, :, None], chunk.index]  # b H r w bq bk
    return picked.permute(0, 1, 2, 4, 3, 5).reshape(b, heads, chunk.stop - chunk.start, block, -1)


@dataclass(frozen=True)
class Masks:
    """Additive masks in DeepSpeed's convention, already turned into additions: ``key_padding``
    ``(b, L)``, ``attn`` ``(L, L)``, ``rpe`` broadcastable to ``(b, h, L, L)``; ``causal`` hides keys
    after each query (ours: what a decoder needs inside its diagonal blocks)."""

    key_padding: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    rpe: torch.Tensor | None = None
    causal: bool = False


def _chunk_scores(q: torch.Tensor, kb: torch.Tensor, chunk: RowChunk, block: int, masks: Masks,
                  acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked scores ``(b, h, rows, block, width * block)`` in ``acc`` of the (pre-scaled) queries,
    and the gathered keys."""
    b, h, rows = q.shape[0], q.shape[1], chunk.stop - chunk.start
    heads = torch.arange(h, device=q.device)[:, None, None]
    kg = kb[:, heads, chunk.index].reshape(b, h, rows, -1, q.shape[-1])  # b h r (w bk) d
    qc = q.reshape(b, h, -1, block, q.shape[-1])[:, :, chunk.start:chunk.stop]
    s = torch.matmul(qc, kg.transpose(-1, -2)).to(acc)
    if masks.rpe is not None:
        rpe = masks.rpe.reshape((1,) * (4 - masks.rpe.dim()) + tuple(masks.rpe.shape))
        s += _gather_pairs(rpe, chunk, block, h).to(acc)
    if masks.key_padding is not None:
        kp = masks.key_padding.reshape(masks.key_padding.shape[0], -1, block)  # b n bk
        s += kp[:, chunk.index].reshape(kp.shape[0], h, rows, 1, -1).to(acc)
    if masks.attn is not None:
        s += _gather_pairs(masks.attn[None, None], chunk, block, h).to(acc)
    s6 = s.view(b, h, rows, block, -1, block)
    s6.masked_fill_(chunk.hidden[None, :, :, None, :, None], float("-inf"))  # broadcast: no full-size mask
    if chunk.diagonal is not None:  # Note [exactness]: only the row's own block is cut by causality
        hh, rr, slot = chunk.diagonal
        own = s6[:, hh, rr, :, slot, :]  # b n bq bk, a copy
        above = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
        s6[:, hh, rr, :, slot, :] = own.masked_fill(above, float("-inf"))
    return s, kg


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunks, block, scale, masks):  # type: ignore[override]
        b, h, length, d = q.shape
        acc = _acc_dtype(q.dtype)
        kb, vb = k.reshape(b, h, -1, block, d), v.reshape(b, h, -1, block, d)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, length, dtype=acc, device=q.device)
        qs = q * scale
        heads = torch.arange(h, device=q.device)[:, None, None]
        for chunk in chunks:
            s, _ = _chunk_scores(qs, kb, chunk, block, masks, acc)
            rows = slice(chunk.start * block, chunk.stop * block)
            m = s.amax(dim=-1, keepdim=True)  # one exp pass: s becomes exp(s - m), then p
            m.masked_fill_(m == float("-inf"), 0.0)  # Note [hidden rows]: a row with every key hidden
            total = s.sub_(m).exp_().sum(dim=-1, keepdim=True).clamp_min_(1.0)  # >= 1 for any other row
            p = s.div_(total).to(q.dtype)
            m = m + total.log()
            vg = vb[:, heads, chunk.index].reshape(b, h, chunk.stop - chunk.start, -1, d)
            out[:, :, rows] = torch.matmul(p, vg).reshape(b, h, -1, d)
            lse[:, :, rows] = m.reshape(b, h, -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.block, ctx.scale, ctx.masks = chunks, block, scale, masks
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        chunks, block, scale, masks = ctx.chunks, ctx.block, ctx.scale, ctx.masks
        b, h, length, d = q.shape
        acc = _acc_dtype(q.dtype)
        grad_acc = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
        kb, vb = k.reshape(b, h, -1, block, d), v.reshape(b, h, -1, block, d)
        n = length // block
        grad_out = grad_out.contiguous()
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # b h L: rowsum(dO * O) = rowsum(P * dP)
        dq = torch.empty_like(q)
        dk = torch.zeros(b, h * n, block, d, dtype=grad_acc, device=q.device)
        dv = torch.zeros_like(dk)
        heads = torch.arange(h, device=q.device)[:, None, None]
        qs = q * scale
        for chunk in chunks:
            r = chunk.stop - chunk.start
            rows = slice(chunk.start * block, chunk.stop * block)
            s, kg = _chunk_scores(qs, kb, chunk, block, masks, acc)
            p = s.sub_(lse[:, :, rows].reshape(b, h, r, block, 1)).exp_()
            vg = vb[:, heads, chunk.index].reshape(b, h, r, -1, d)
            go = grad_out[:, :, rows].reshape(b, h, r, block, d)
            dp = torch.matmul(go, vg.transpose(-1, -2)).to(acc)
            ds = dp.sub_(delta[:, :, rows].reshape(b, h, r, block, 1)).mul_(p).to(q.dtype)  # scale: below
            dq[:, :, rows] = torch.matmul(ds, kg).reshape(b, h, -1, d).mul_(scale)
            flat = (heads * n + chunk.index).flatten()
            qc = qs[:, :, rows].reshape(b, h, r, block, d)
            dk.index_add_(1, flat, torch.matmul(ds.transpose(-1, -2), qc).reshape(b, -1, block, d).to(grad_acc))
            dv.index_add_(1, flat, torch.matmul(p.to(q.dtype).transpose(-1, -2), go).reshape(
                b, -1, block, d).to(grad_acc))
        shape = (b, h, length, d)
        return dq, dk.reshape(shape).to(k.dtype), dv.reshape(shape).to(v.dtype), None, None, None, None


def check_constant_masks(masks: Masks) -> None:
    """Refuse masks that require grad: both executors treat them as constants."""
    for name, mask in (("rpe", masks.rpe), ("key_padding_mask", masks.key_padding), ("attn_mask", masks.attn)):
        if mask is not None and mask.requires_grad:
            raise ValueError(f"{name} requires grad, but sparse attention treats it as a constant: pass it detached")


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[RowChunk], block: int,
                           scale: float, masks: Masks = Masks()) -> torch.Tensor:
    """Attention of ``(batch, heads, L, head_dim)`` tensors over the blocks ``chunks`` name (from
    :func:`row_chunks`), exact (Note [exactness]); ``L`` must be a multiple of ``block``."""
    check_constant_masks(masks)
    return _BlockSparseAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), chunks, block, scale, masks)
