"""``SparseSelfAttention``: DeepSpeed's module and forward signature over a sparsity config, running
the row-group executor, the block-sparse kernel or FlexAttention, whichever runs the call best
(Note [executor choice])."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_zero.sparse_attention.block_sparse import (
    DEFAULT_CHUNK_ELEMENTS,
    Masks,
    RowChunk,
    block_sparse_attention,
    check_constant_masks,
    row_chunks,
)
from lightning_zero.sparse_attention.flex import flex_runs, flex_sparse_attention, make_block_mask
from lightning_zero.sparse_attention.packed_layout import PackedLayout
from lightning_zero.sparse_attention.row_groups import (
    GroupBatch,
    GroupPolicy,
    batch_groups,
    plan_row_groups,
    row_group_attention,
    row_groups_available,
)
from lightning_zero.sparse_attention.sparsity_config import SparsityConfig

MASK_MODES = ("add", "mul")
EXECUTORS = ("auto", "row_groups", "block_sparse", "flex")

# Note [executor choice]: "auto" takes FlexAttention where it runs the call (CUDA; CPU when no
# gradient is needed, e.g. inference) and the row-group executor otherwise (CPU training: groups of
# query-block rows batched through torch's CPU flash kernel, row_groups.py), which beats the
# pure-torch block-sparse kernel at every length measured (docs/benchmarks.md). All three are exact
# (tests/unit/test_sparse_attention.py, tests/unit/test_sparse_row_groups.py), so switching between them
# changes nothing but speed and memory. "row_groups", "block_sparse" and "flex" force one; "flex"
# refuses a CPU call that needs grad, "row_groups" a CUDA call.


def _additive(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """DeepSpeed's mask conventions as an addition: ``add`` as is, ``mul``: 0 -> -inf, else 0. A boolean mask
    (PyTorch's and Hugging Face's SDPA convention: True attends) means the same in either mode: it is never
    added as 0 / 1."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    if mode == "add":
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, float("-inf"))


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention (DeepSpeed's ``SparseSelfAttention``).

    Args:
        sparsity_config: the layout's pattern (:mod:`~lightning_zero.sparse_attention.sparsity_config`).
        key_padding_mask_mode: ``"add"`` (added to the scores) or ``"mul"`` (0 hides the key).
        attn_mask_mode: ``"add"`` or ``"mul"``, the same for ``attn_mask``.
        max_seq_length: the longest sequence; the layout (``master_layout``, bool, on the CPU; kept as bits)
            is made for it and cut to each call's length.
        causal: (ours) hide the keys after each query, also inside the layout's diagonal blocks.
        executor: (ours) ``"auto"``, ``"block_sparse"`` or ``"flex"`` (Note [executor choice]).
        chunk_elements: (ours) score elements per chunk: the block-sparse kernel's (Note [chunked rows],
            default 4M) or the row-group executor's scores per batch (Note [row-group chunks], default 256K).
        group_policy: (ours) how the row-group executor groups rows (Note [row groups]); its
            ``chunk_elements`` gives way to the argument above when that is given.
    """

    def __init__(self, sparsity_config: SparsityConfig, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, causal: bool = False,
                 executor: str = "auto", chunk_elements: int | None = None,
                 group_policy: GroupPolicy | None = None) -> None:
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"{name}={mode!r}: choose 'add' or 'mul'")
        if executor not in EXECUTORS:
            raise ValueError(f"executor={executor!r}: choose one of {EXECUTORS}")
        if max_seq_length % sparsity_config.block:
            raise ValueError(f"max_seq_length {max_seq_length} is not a multiple of the block size "
                             f"{sparsity_config.block}")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.causal = causal
        self.executor = executor
        self.chunk_elements = chunk_elements
        self._group_policy = group_policy or GroupPolicy()
        # a plain attribute, not a buffer: made from the config (seeded), it is no state to save or shard; kept
        # as bits, once when every head shares it (Note [layout as bits]): 0.5 MiB at 16k tokens, block 8
        # built as bool for the distinct head layouts only, not make_layout's int64 for every head (128 MiB at 16k
        # tokens with blocks of 8 and 4 heads, all of it resident while the module was built)
        self._layout = PackedLayout(sparsity_config.make_distinct_bool_layout(max_seq_length),
                                    heads=sparsity_config.num_heads)
        self._chunks: dict[tuple[int, int, str], list[RowChunk]] = {}
        self._group_batches: dict[tuple[int, int, str], list[GroupBatch]] = {}
        self._block_masks: dict[tuple[int, str], Any] = {}

    def narrowed_to_heads(self, start: int, stop: int) -> SparseSelfAttention:
        """A copy over heads ``[start, stop)`` only (their own layouts; sequence parallel runs each rank's heads
        after its all-to-all), with its own executor caches: a plan made for all heads never serves it."""
        local = copy.copy(self)  # no parameters: the config, the layout and the caches only
        local.sparsity_config = copy.copy(self.sparsity_config)
        local.sparsity_config.num_heads = stop - start
        local._layout = self._layout.heads_slice(start, stop)
        local._chunks, local._group_batches, local._block_masks = {}, {}, {}
        return local

    def get_layout(self, length: int) -> torch.Tensor:
        """The layout of a ``length``-token call: the master layout's top-left corner."""
        block = self.sparsity_config.block
        if length % block:
            raise ValueError(f"sequence length {length} is not a multiple of the block size {block}: pad it with "
                             "SparseAttentionUtils.pad_to_block_size (and unpad_sequence_output after)")
        if length > self.max_seq_length:
            raise ValueError(f"sequence length {length} exceeds max_seq_length {self.max_seq_length}: build "
                             "SparseSelfAttention with a larger max_seq_length")
        return self._layout.corner(length // block)

    @property
    def master_layout(self) -> torch.Tensor:
        """The bool layout made for ``max_seq_length`` (unpacked from its bits on each access; a broadcast view
        over the heads when they share it)."""
        return self._layout.corner(self._layout.blocks)

    def _row_chunks(self, length: int, batch_heads: int, device: torch.device) -> list[RowChunk]:
        key = (length, batch_heads, str(device))
        if key not in self._chunks:
            layout = self.get_layout(length).to(device)
            self._chunks[key] = row_chunks(layout, self.sparsity_config.block, batch_heads,
                                           self.chunk_elements or DEFAULT_CHUNK_ELEMENTS, self.causal)
        return self._chunks[key]

    def group_policy(self) -> GroupPolicy:
        """The row-group executor's policy (its ``chunk_elements`` the module's, when given)."""
        if self.chunk_elements:
            return replace(self._group_policy, chunk_elements=self.chunk_elements)
        return self._group_policy

    def _row_group_batches(self, length: int, batch: int, device: torch.device) -> list[GroupBatch]:
        key = (length, batch, str(device))
        if key not in self._group_batches:
            layout, block = self.get_layout(length), self.sparsity_config.block
            policy = self.group_policy()
            self._group_batches[key] = batch_groups(plan_row_groups(layout, block, policy), layout, block, batch,
                                                    policy, device)
        return self._group_batches[key]

    def _block_mask(self, length: int, device: torch.device) -> Any:
        key = (length, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = make_block_mask(self.get_layout(length), self.sparsity_config.block, length,
                                                     self.causal, device)
        return self._block_masks[key]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Attention output ``(batch, heads, L, head_dim)``. ``key`` may come transposed
        (``(batch, heads, head_dim, L)``); ``key_padding_mask`` is ``(batch, L)`` (extra unit dims
        squeezed), ``attn_mask`` ``(L, L)``, ``rpe`` broadcastable to ``(batch, heads, L, L)``."""
        if query.dim() != 4:
            raise ValueError(f"query must be (batch, heads, seq, head_dim), got shape {tuple(query.shape)}")
        b, h, length, d = query.shape
        if key.shape[-2] != length and key.shape[-1] == length:
            key = key.transpose(-1, -2)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError(f"only self-attention is supported: query {tuple(query.shape)}, key "
                                      f"{tuple(key.shape)}, value {tuple(value.shape)} must have one shape")
        if h != self.sparsity_config.num_heads:
            raise ValueError(f"query has {h} heads, the sparsity config {self.sparsity_config.num_heads}")
        acc = torch.float64 if query.dtype == torch.float64 else torch.float32
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.reshape(key_padding_mask.shape[0], -1)
            if key_padding_mask.shape[-1] != length:
                raise ValueError(f"key_padding_mask must be (batch, {length}), got {tuple(key_padding_mask.shape)}")
            key_padding_mask = _additive(key_padding_mask, self.key_padding_mask_mode, acc)
        if attn_mask is not None:
            attn_mask = attn_mask.reshape(attn_mask.shape[-2:]) if attn_mask.dim() > 2 else attn_mask
            if tuple(attn_mask.shape) != (length, length):
                raise ValueError(f"attn_mask must be ({length}, {length}), got {tuple(attn_mask.shape)}")
            attn_mask = _additive(attn_mask, self.attn_mask_mode, acc)
        masks = Masks(key_padding_mask, attn_mask, rpe, self.causal)
        check_constant_masks(masks)
        scale = float(d) ** -0.5
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        use_flex = self.executor == "flex" or (self.executor == "auto" and flex_runs(query, needs_grad))
        if use_flex:
            if not flex_runs(query, needs_grad):
                raise RuntimeError("executor='flex' cannot run here: FlexAttention has no backward on CPU (nor "
                                   "float64 there); use executor='auto' or 'block_sparse'")
            self.get_layout(length)  # the length checks
            return flex_sparse_attention(query, key, value, self._block_mask(length, query.device), scale, masks)
        if self.executor == "row_groups" or (self.executor == "auto" and row_groups_available(query)):
            if not row_groups_available(query):
                raise RuntimeError(f"executor='row_groups' runs torch's CPU flash kernel, not on {query.device}: "
                                   "use executor='auto' or 'flex'")
            batches = self._row_group_batches(length, b, query.device)
            return row_group_attention(query, key, value, batches, self.sparsity_config.block, scale, masks)
        chunks = self._row_chunks(length, b * h, query.device)
        return block_sparse_attention(query, key, value, chunks, self.sparsity_config.block, scale, masks)
