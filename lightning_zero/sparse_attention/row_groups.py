"""The row-group executor: block-sparse attention as batched calls of PyTorch's CPU flash-attention
kernel, one batch item per group of query-block rows (Note [row groups]); exact, memory linear in length.

Note [row groups]: consecutive query-block rows of one head whose key blocks mostly coincide (a fixed
layout's window: its own blocks plus the earlier windows' global blocks) form a group. The group's
keys are the union of its rows' key blocks; a token-level mask hides what a row does not attend to
(blocks outside its layout row, keys after the query when causal, padding slots), so the group's
attention is exactly the rows' sparse attention. ``plan_row_groups`` cuts each head's rows into
groups of at most ``max_tokens`` query tokens by dynamic programming, minimising the computed work
(rows x union width, masked blocks included) plus a fixed cost per group (``group_tokens`` squared:
tiny kernel calls cost more than the masked work they save). The plan costs no more than one row
per group would, so the masked work is bounded by the per-group cost times the rows; a fixed
layout's groups come out as its windows, or parts of them.

Note [row-group chunks]: groups with the same row count are sorted by width and batched, each batch
padded to its widest group (padded key slots are masked), so that a batch's scores (batch x heads x
query x key tokens, what the mask would hold with per-head masks; shared by the heads otherwise)
stay under ``chunk_elements``; the gathered queries, keys and values are smaller still. The kernel
takes a group's heads (all of them when the layout's heads are equal) as its head dimension, so one
mask serves them. The custom autograd Function saves only q, k, v, the output and the log-sum-exp;
the backward regathers each batch and calls the kernel's own backward with the saved output and
log-sum-exp, so nothing of a batch outlives it. Peak memory: the inputs, output and gradients plus
one batch (docs/benchmarks.md: below causal SDPA's at 16k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_zero.sparse_attention.block_sparse import Masks, check_constant_masks


@dataclass(frozen=True)
class GroupPolicy:
    """How rows are grouped and batched (Notes [row groups], [row-group chunks])."""

    group_tokens: int = 128  # a group's fixed cost: the work of this many query x key tokens squared
    max_tokens: int = 256  # the most query tokens in a group
    chunk_elements: int = 1 << 18  # one batch's scores (batch x heads x query x key tokens): 256K elements

    def __post_init__(self) -> None:
        for name in ("group_tokens", "max_tokens", "chunk_elements"):
            if getattr(self, name) < 1:
                raise ValueError(f"GroupPolicy.{name}={getattr(self, name)}: must be a positive number of tokens "
                                 "(elements for chunk_elements)")


@dataclass(frozen=True)
class RowGroup:
    """Query-block rows ``[start, stop)`` of ``head`` (``None``: every head, the layout's heads being
    equal) and the key blocks ``keys`` (increasing) any of them attends to."""

    head: int | None
    start: int
    stop: int
    keys: tuple[int, ...]


def row_groups_available(q: torch.Tensor) -> bool:
    """Whether this executor runs ``q``'s call: a CPU tensor and torch's CPU flash kernel present."""
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _plan_head(layout: torch.Tensor, head: int | None, block: int, policy: GroupPolicy) -> list[RowGroup]:
    n = layout.shape[0]
    max_rows = max(1, min(n, policy.max_tokens // block))
    overhead = (policy.group_tokens / block) ** 2  # in blocks of work
    # widths[r - 1][s]: union width of rows [s, s + r); unions grown one row at a time for every start
    union, widths = layout.clone(), [layout.sum(-1).tolist()]
    for r in range(2, max_rows + 1):
        union = union[:-1] | layout[r - 1:]
        widths.append(union.sum(-1).tolist())
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for stop in range(1, n + 1):  # best[stop]: the cheapest cover of rows [0, stop)
        for r in range(1, min(max_rows, stop) + 1):
            cost = best[stop - r] + r * widths[r - 1][stop - r] + overhead
            if cost < best[stop]:
                best[stop], cut[stop] = cost, stop - r
    groups, stop = [], n
    while stop:
        start = cut[stop]
        groups.append(RowGroup(head, start, stop, tuple(layout[start:stop].any(0).nonzero().flatten().tolist())))
        stop = start
    return groups[::-1]


def plan_row_groups(layout: torch.Tensor, block: int, policy: GroupPolicy = GroupPolicy()) -> list[RowGroup]:
    """Cut a ``(heads, blocks, blocks)`` layout into :class:`RowGroup` s (Note [row groups]): every
    (head, row) lies in exactly one group, whose keys contain the row's."""
    layout = layout.bool().cpu()
    counts = layout.sum(-1)
    if int(counts.min()) == 0:
        head, row = (int(i) for i in (counts == 0).nonzero()[0])
        raise ValueError(f"row {row} of head {head}'s layout attends to no block: its softmax would be empty (nan)")
    if bool((layout == layout[:1]).all()):
        return _plan_head(layout[0], None, block, policy)
    return [g for h in range(layout.shape[0]) for g in _plan_head(layout[h], h, block, policy)]


@dataclass(frozen=True)
class GroupBatch:
    """Groups run as one kernel call, the group's heads (all of them for shared groups, else its own)
    as the kernel's head dimension: ``rows`` (G, hc, R) and ``keys`` (G, hc, W) flat block indices
    into a ``(b, heads * blocks, block, d)`` view; ``heads`` (G, hc); ``allowed`` (G, R, W) the
    block-level mask (layout row membership, padded slots hidden); ``q_tok`` (G, R*block) and
    ``k_tok`` (G, W*block) token positions, for causality and the masks gathered per token."""

    rows: torch.Tensor
    keys: torch.Tensor
    heads: torch.Tensor
    allowed: torch.Tensor
    q_tok: torch.Tensor
    k_tok: torch.Tensor


def batch_groups(groups: list[RowGroup], layout: torch.Tensor, block: int, batch: int,
                 policy: GroupPolicy = GroupPolicy(), device: torch.device | str = "cpu") -> list[GroupBatch]:
    """The groups as :class:`GroupBatch` es (Note [row-group chunks]): same row count, sorted by width,
    each batch's scores (``batch`` x heads x rows x width tokens) under ``policy.chunk_elements``."""
    layout = layout.bool().cpu()
    heads = layout.shape[0] if groups and groups[0].head is None else 1
    groups = sorted(groups, key=lambda g: (g.stop - g.start, len(g.keys)))
    batches, i = [], 0
    while i < len(groups):
        rows = groups[i].stop - groups[i].start
        j = i + 1
        while (j < len(groups) and groups[j].stop - groups[j].start == rows and batch * heads * (j + 1 - i) * rows
               * len(groups[j].keys) * block * block <= policy.chunk_elements):
            j += 1
        batches.append(_make_batch(groups[i:j], layout, block, device))
        i = j
    return batches


def _make_batch(groups: list[RowGroup], layout: torch.Tensor, block: int, device: torch.device | str) -> GroupBatch:
    n, width = layout.shape[1], max(len(g.keys) for g in groups)
    heads = torch.tensor([[g.head] if g.head is not None else list(range(layout.shape[0])) for g in groups])
    row_idx = torch.stack([torch.arange(g.start, g.stop) for g in groups])  # G R
    key_idx = torch.zeros(len(groups), width, dtype=torch.long)
    valid = torch.zeros(len(groups), width, dtype=torch.bool)
    for t, g in enumerate(groups):
        key_idx[t, :len(g.keys)] = torch.tensor(g.keys, dtype=torch.long)
        valid[t, :len(g.keys)] = True
    allowed = layout[heads[:, :1, None], row_idx[:, :, None], key_idx[:, None, :]] & valid[:, None, :]
    offsets = torch.arange(block)
    q_tok = (row_idx[:, :, None] * block + offsets).flatten(1)
    k_tok = (key_idx[:, :, None] * block + offsets).flatten(1)
    flat_rows = heads[:, :, None] * n + row_idx[:, None, :]
    flat_keys = heads[:, :, None] * n + key_idx[:, None, :]
    return GroupBatch(*(x.to(device) for x in (flat_rows, flat_keys, heads, allowed, q_tok, k_tok)))


def _additive_mask(gb: GroupBatch, block: int, batch: int, masks: Masks, dtype: torch.dtype) -> torch.Tensor:
    """The batch's additive mask, ``(G, 1, R*block, W*block)`` (broadcast over the kernel's heads) or
    ``(G, batch * hc, ...)`` with key-padding / attention / rpe masks (already additive) gathered in:
    0 where attended, -inf where hidden."""
    g, r, w = gb.allowed.shape
    allowed = gb.allowed[:, :, None, :, None].expand(g, r, block, w, block).reshape(g, r * block, w * block)
    if masks.causal:
        allowed = allowed & (gb.k_tok[:, None, :] <= gb.q_tok[:, :, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    mask = mask[:, None, None]  # G b hc Q K
    if masks.key_padding is None and masks.attn is None and masks.rpe is None:
        return mask[:, 0]
    if masks.key_padding is not None:
        mask = mask + masks.key_padding[:, gb.k_tok].transpose(0, 1)[:, :, None, None, :].to(dtype)
    if masks.attn is not None:
        mask = mask + masks.attn[gb.q_tok[:, :, None], gb.k_tok[:, None, :]][:, None, None].to(dtype)
    if masks.rpe is not None:
        rpe = masks.rpe.reshape((1,) * (4 - masks.rpe.dim()) + tuple(masks.rpe.shape))
        hsel = gb.heads if rpe.shape[1] > 1 else torch.zeros_like(gb.heads)  # G hc
        picked = rpe[:, hsel[:, :, None, None], gb.q_tok[:, None, :, None], gb.k_tok[:, None, None, :]]
        mask = mask + picked.transpose(0, 1).to(dtype)  # G b' hc Q K
    hc = gb.heads.shape[1]
    return mask.expand(g, batch, hc, r * block, w * block).reshape(g, batch * hc, r * block, w * block)


def _mask_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ``(b, heads * blocks, block, d)`` at the flat block indices ``index`` ``(G, hc, m)``, as the
    kernel's ``(G, b * hc, m * block, d)`` (a view of the gather when ``b`` is 1)."""
    g, hc, m = index.shape
    return x[:, index].transpose(0, 1).reshape(g, x.shape[0] * hc, m * x.shape[2], x.shape[3])


def _scatter_view(y: torch.Tensor, b: int, hc: int, block: int) -> torch.Tensor:
    """The kernel's ``(G, b * hc, m * block, ...)`` back as ``(b, G, hc, m, block, ...)``."""
    g, _, mb = y.shape[:3]
    return y.reshape(g, b, hc, mb // block, block, *y.shape[3:]).transpose(0, 1)


class _RowGroupAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, batches, block, scale, masks):  # type: ignore[override]
        b, h, length, d = q.shape
        views = [x.view(b, -1, block, d) for x in (q, k, v)]
        out = torch.empty_like(q)
        lse = torch.empty(b, h, length, dtype=_mask_dtype(q.dtype), device=q.device)
        out_v, lse_v = out.view(b, -1, block, d), lse.view(b, -1, block)
        for gb in batches:
            hc = gb.heads.shape[1]
            qg, kg, vg = (_gather(x, idx) for x, idx in zip(views, (gb.rows, gb.keys, gb.keys)))
            mask = _additive_mask(gb, block, b, masks, _mask_dtype(q.dtype))
            o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, kg, vg, attn_mask=mask,
                                                                               scale=scale)
            out_v[:, gb.rows] = _scatter_view(o, b, hc, block)
            lse_v[:, gb.rows] = _scatter_view(m, b, hc, block).to(lse.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.batches, ctx.block, ctx.scale, ctx.masks = batches, block, scale, masks
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        batches, block, scale, masks = ctx.batches, ctx.block, ctx.scale, ctx.masks
        b, h, length, d = q.shape
        grad_acc = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
        views = [x.reshape(b, -1, block, d) for x in (q, k, v, out, grad_out.contiguous())]
        lse_v = lse.view(b, -1, block, 1)
        dq = torch.empty_like(q)
        dq_v = dq.view(b, -1, block, d)
        dk = torch.zeros(b, h * (length // block), block, d, dtype=grad_acc, device=q.device)
        dv = torch.zeros_like(dk)
        for gb in batches:
            hc = gb.heads.shape[1]
            idx = (gb.rows, gb.keys, gb.keys, gb.rows, gb.rows)
            qg, kg, vg, og, gog = (_gather(x, i) for x, i in zip(views, idx))
            mask = _additive_mask(gb, block, b, masks, _mask_dtype(q.dtype))
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gog, qg, kg, vg, og, _gather(lse_v, gb.rows)[..., 0], 0.0, False, attn_mask=mask, scale=scale)
            dq_v[:, gb.rows] = _scatter_view(gq, b, hc, block)
            flat = gb.keys.flatten()
            dk.index_add_(1, flat, _scatter_view(gk, b, hc, block).reshape(b, -1, block, d).to(grad_acc))
            dv.index_add_(1, flat, _scatter_view(gv, b, hc, block).reshape(b, -1, block, d).to(grad_acc))
        shape = (b, h, length, d)
        return dq, dk.reshape(shape).to(k.dtype), dv.reshape(shape).to(v.dtype), None, None, None, None


def row_group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batches: list[GroupBatch], block: int,
                        scale: float, masks: Masks | None = None) -> torch.Tensor:
    """Attention of ``(batch, heads, L, head_dim)`` CPU tensors over the groups ``batches`` hold (from
    :func:`batch_groups`), exact (Note [row groups]); ``L`` must be a multiple of ``block``."""
    masks = masks or Masks()
    check_constant_masks(masks)
    if not row_groups_available(q):
        raise RuntimeError("the row-group executor runs torch's CPU flash kernel: use a CPU tensor, or "
                           "executor='auto' / 'flex' on CUDA")
    return _RowGroupAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), batches, block, scale, masks)
