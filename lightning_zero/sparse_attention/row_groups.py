"""The row-group executor: block-sparse attention as batched calls of PyTorch's CPU flash-attention
kernel, one batch item per group of query-block rows (Note [row groups]); exact, memory linear in length.

Note [row groups]: consecutive query-block rows of one head whose key blocks mostly coincide (a fixed
layout's window: its own blocks plus the earlier windows' global blocks) form a group. The group's
keys are the union of its rows' key blocks; a token-level mask hides what a row does not attend to
(blocks outside its layout row, keys after the query when causal, padding slots), so the group's
attention is exactly the rows' sparse attention. ``plan_row_groups`` grows a group while its
computed work (rows x union width) stays within ``waste_ratio`` of the rows' own work (the sum of
their widths), up to ``max_tokens`` query tokens; groups shorter than ``min_tokens`` grow regardless
(tiny flash calls cost more than the masked work they save).

Note [row-group chunks]: groups with the same row count are sorted by width and batched, each batch
padded to its widest group (padded key slots are masked), so that a batch's mask (the only tensor
the size of its scores) stays under ``chunk_elements``. The custom autograd Function saves only
q, k, v, the output and the log-sum-exp; the backward regathers each batch and calls the kernel's
own backward with the saved output and log-sum-exp, so nothing of a batch outlives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_zero.sparse_attention.block_sparse import Masks, check_constant_masks


@dataclass(frozen=True)
class GroupPolicy:
    """How rows are grouped and batched (Notes [row groups], [row-group chunks])."""

    waste_ratio: float = 1.3
    max_tokens: int = 256
    min_tokens: int = 64
    chunk_elements: int = 1 << 20  # one batch's mask: 1M elements (4 MiB in float32)


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
    widths = layout.sum(-1).tolist()
    groups, n, start = [], layout.shape[0], 0
    max_rows, min_rows = max(1, policy.max_tokens // block), max(1, policy.min_tokens // block)
    while start < n:
        union, own, stop = layout[start].clone(), widths[start], start + 1
        while stop < n and stop - start < max_rows:
            grown = union | layout[stop]
            rows = stop + 1 - start
            if rows > min_rows and rows * int(grown.sum()) > policy.waste_ratio * (own + widths[stop]):
                break
            union, own, stop = grown, own + widths[stop], stop + 1
        groups.append(RowGroup(head, start, stop, tuple(union.nonzero().flatten().tolist())))
        start = stop
    return groups


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
    """Groups run as one kernel call: ``rows`` (T, R) and ``keys`` (T, W) flat block indices into a
    ``(b, heads * blocks, block, d)`` view; ``heads`` (T,); ``allowed`` (T, R, W) the block-level
    mask (layout row membership, padded slots hidden); ``q_tok`` (T, R*block) and ``k_tok``
    (T, W*block) token positions, for causality and the masks gathered per token."""

    rows: torch.Tensor
    keys: torch.Tensor
    heads: torch.Tensor
    allowed: torch.Tensor
    q_tok: torch.Tensor
    k_tok: torch.Tensor


def batch_groups(groups: list[RowGroup], layout: torch.Tensor, block: int, batch: int,
                 policy: GroupPolicy = GroupPolicy(), device: torch.device | str = "cpu") -> list[GroupBatch]:
    """The groups (every head's, for shared ones) as :class:`GroupBatch` es (Note [row-group chunks])."""
    layout = layout.bool().cpu()
    heads, n = layout.shape[0], layout.shape[1]
    tasks = [(h, g) for g in groups for h in ([g.head] if g.head is not None else range(heads))]
    tasks.sort(key=lambda t: (t[1].stop - t[1].start, len(t[1].keys)))
    batches, i = [], 0
    while i < len(tasks):
        rows = tasks[i][1].stop - tasks[i][1].start
        j = i + 1
        while (j < len(tasks) and tasks[j][1].stop - tasks[j][1].start == rows
               and batch * (j + 1 - i) * rows * len(tasks[j][1].keys) * block * block <= policy.chunk_elements):
            j += 1
        batches.append(_make_batch(tasks[i:j], layout, n, block, device))
        i = j
    return batches


def _make_batch(tasks: list[tuple[int, RowGroup]], layout: torch.Tensor, n: int, block: int,
                device: torch.device | str) -> GroupBatch:
    width = max(len(g.keys) for _, g in tasks)
    heads = torch.tensor([h for h, _ in tasks])
    row_idx = torch.stack([torch.arange(g.start, g.stop) for _, g in tasks])  # T R
    key_idx = torch.zeros(len(tasks), width, dtype=torch.long)
    valid = torch.zeros(len(tasks), width, dtype=torch.bool)
    for t, (_, g) in enumerate(tasks):
        key_idx[t, :len(g.keys)] = torch.tensor(g.keys, dtype=torch.long)
        valid[t, :len(g.keys)] = True
    allowed = layout[heads[:, None, None], row_idx[:, :, None], key_idx[:, None, :]] & valid[:, None, :]
    offsets = torch.arange(block)
    q_tok = (row_idx[:, :, None] * block + offsets).flatten(1)
    k_tok = (key_idx[:, :, None] * block + offsets).flatten(1)
    return GroupBatch(*(x.to(device) for x in (heads[:, None] * n + row_idx, heads[:, None] * n + key_idx, heads,
                                                allowed, q_tok, k_tok)))


def _additive_mask(gb: GroupBatch, block: int, masks: Masks, dtype: torch.dtype) -> torch.Tensor:
    """The batch's additive mask ``(1 or b, T, R*block, W*block)``: 0 where attended, -inf where hidden,
    plus the gathered key-padding / attention / rpe masks (already additive)."""
    t, r, w = gb.allowed.shape
    allowed = gb.allowed[:, :, None, :, None].expand(t, r, block, w, block).reshape(t, r * block, w * block)
    if masks.causal:
        allowed = allowed & (gb.k_tok[:, None, :] <= gb.q_tok[:, :, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    mask = mask[None]
    if masks.key_padding is not None:
        mask = mask + masks.key_padding[:, gb.k_tok][:, :, None, :].to(dtype)
    if masks.attn is not None:
        mask = mask + masks.attn[gb.q_tok[:, :, None], gb.k_tok[:, None, :]].to(dtype)
    if masks.rpe is not None:
        rpe = masks.rpe.reshape((1,) * (4 - masks.rpe.dim()) + tuple(masks.rpe.shape))
        hsel = gb.heads if rpe.shape[1] > 1 else torch.zeros_like(gb.heads)
        mask = mask + rpe[:, hsel[:, None, None], gb.q_tok[:, :, None], gb.k_tok[:, None, :]].to(dtype)
    return mask


def _mask_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RowGroupAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, batches, block, scale, masks):  # type: ignore[override]
        b, h, length, d = q.shape
        views = [x.view(b, -1, block, d) for x in (q, k, v)]
        out = torch.empty_like(q)
        lse = torch.empty(b, h, length, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype,
                          device=q.device)
        out_v, lse_v = out.view(b, -1, block, d), lse.view(b, -1, block)
        for gb in batches:
            t, r = gb.rows.shape
            qg, kg, vg = (x[:, idx].reshape(b, t, -1, d) for x, idx in zip(views, (gb.rows, gb.keys, gb.keys)))
            mask = _additive_mask(gb, block, masks, _mask_dtype(q.dtype))
            o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, kg, vg, attn_mask=mask,
                                                                               scale=scale)
            out_v[:, gb.rows] = o.reshape(b, t, r, block, d)
            lse_v[:, gb.rows] = m.reshape(b, t, r, block).to(lse.dtype)
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
        lse_v = lse.view(b, -1, block)
        dq = torch.empty_like(q)
        dq_v = dq.view(b, -1, block, d)
        dk = torch.zeros(b, h * (length // block), block, d, dtype=grad_acc, device=q.device)
        dv = torch.zeros_like(dk)
        for gb in batches:
            t, r = gb.rows.shape
            idx = (gb.rows, gb.keys, gb.keys, gb.rows, gb.rows)
            qg, kg, vg, og, gog = (x[:, i].reshape(b, t, -1, d) for x, i in zip(views, idx))
            mask = _additive_mask(gb, block, masks, _mask_dtype(q.dtype))
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gog, qg, kg, vg, og, lse_v[:, gb.rows].reshape(b, t, -1), 0.0, False, attn_mask=mask, scale=scale)
            dq_v[:, gb.rows] = gq.reshape(b, t, r, block, d)
            flat = gb.keys.flatten()
            dk.index_add_(1, flat, gk.reshape(b, -1, block, d).to(grad_acc))
            dv.index_add_(1, flat, gv.reshape(b, -1, block, d).to(grad_acc))
        shape = (b, h, length, d)
        return dq, dk.reshape(shape).to(k.dtype), dv.reshape(shape).to(v.dtype), None, None, None, None


def row_group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batches: list[GroupBatch], block: int,
                        scale: float, masks: Masks = Masks()) -> torch.Tensor:
    """Attention of ``(batch, heads, L, head_dim)`` CPU tensors over the groups ``batches`` hold (from
    :func:`batch_groups`), exact (Note [row groups]); ``L`` must be a multiple of ``block``."""
    check_constant_masks(masks)
    if not row_groups_available(q):
        raise RuntimeError("the row-group executor runs torch's CPU flash kernel: use a CPU tensor, or "
                           "executor='auto' / 'flex' on CUDA")
    return _RowGroupAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), batches, block, scale, masks)
