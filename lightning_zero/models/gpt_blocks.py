"""One transformer block of the GPT: causal self-attention (dense, block-sparse, sequence or tensor parallel),
the MLP, and ``Block``, the unit that ZeRO stage 3 gathers at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.models.gpt_config import GPTConfig, GPTMoE
from lightning_zero.moe import GroupedMLPExperts, MoELayer, RoutingPolicy, TopKGate
from lightning_zero.sequence_parallel import SequenceGroup
from lightning_zero.sparse_attention import (
    SparseAttentionUtils,
    SparseSelfAttention,
    check_section,
    make_sparsity_config,
)
from lightning_zero.tensor_parallel import ColumnParallelLinear
from lightning_zero.tensor_parallel.rng import split_region_rng


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via ``F.scaled_dot_product_attention``, or through block-sparse
    ``sparse_attention`` when the config has a ``sparse_attention`` section (the attention slot of
    ``lightning_zero/sparse_attention/utils.py``; a sequence not a multiple of the block is padded at the
    end, which causal attention never sees, and cut back)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError("n_embd must be divisible by n_head")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)
        self.sparse_attention: SparseSelfAttention | None = None
        self._tp_sparse: SparseSelfAttention | None = None  # this TP rank's heads of it (made at first use)
        self.sequence_group: SequenceGroup | None = None  # set by GPT.use_sequence_group
        if config.sparse_attention:
            if config.dropout:
                raise ValueError("sparse attention has no attention dropout: set dropout=0 with sparse_attention")
            section = check_section(config.sparse_attention)
            SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
                self, config.seq_len, make_sparsity_config(section, config.n_head),
                executor=section.get("executor", "auto"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # chunk, and -1 heads: under tensor parallelism qkv holds this rank's heads of q, k and v (Colwise(chunks=3))
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        sp = self.sequence_group  # sequence parallel: x is this rank's slice; attention sees the whole sequence
        y = self._attend(q, k, v) if sp is None else sp.attention(q, k, v, self._attend)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.size(2)
        if self.sparse_attention is not None:
            sparse = self._local_sparse()
            pad = -t % sparse.sparsity_config.block
            if pad:
                q, k, v = (F.pad(z, (0, 0, 0, pad)) for z in (q, k, v))
            return sparse(q, k, v)[:, :, :t]
        with split_region_rng(self.qkv):  # split heads: this TP rank's own dropout stream
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)

    def _local_sparse(self) -> SparseSelfAttention:
        """The sparse layer over the heads this rank attends: all of them, or under tensor parallelism this TP
        rank's heads (the qkv projection's slice), under sequence parallelism the group's share after the
        all-to-all; each with its own heads' layouts."""
        assert self.sparse_attention is not None
        if isinstance(self.qkv, ColumnParallelLinear) and self.qkv.tp.size > 1:
            if self._tp_sparse is None:
                n = self.n_head // self.qkv.tp.size
                self._tp_sparse = self.sparse_attention.narrowed_to_heads(self.qkv.tp.rank * n,
                                                                         (self.qkv.tp.rank + 1) * n)
            return self._tp_sparse
        if self.sequence_group is not None:
            return self.sequence_group.local_heads(self.sparse_attention)
        return self.sparse_attention


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(4x) -> GELU -> Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


def moe_mlp(config: GPTConfig, moe: GPTMoE) -> MoELayer:
    """The MoE option's MLP: a top-k router and E GELU expert MLPs as grouped products (moe/layer.py)."""
    policy = RoutingPolicy(moe.num_experts, moe.top_k, moe.capacity_factor, moe.eval_capacity_factor,
                           moe.min_capacity)
    experts = GroupedMLPExperts(moe.num_experts, config.n_embd, moe.intermediate_size or 4 * config.n_embd, "gelu")
    return MoELayer(TopKGate(config.n_embd, policy), experts, moe.num_experts)


class Block(nn.Module):
    """Pre-LayerNorm transformer block (with ``config.moe``, its MLP is a mixture of experts)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp: nn.Module = moe_mlp(config, config.moe) if config.moe is not None else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
