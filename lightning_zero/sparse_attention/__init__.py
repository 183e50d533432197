"""Block-sparse attention (issue 32): DeepSpeed's sparsity configs and their layouts,
``SparseSelfAttention`` with an exact pure-torch block-sparse kernel (CPU training) and FlexAttention
(CUDA training, inference), and the helpers that put it into a model. docs/sparse_attention.md."""

from lightning_zero.sparse_attention.section import (
    ATTENTION_CHOICES,
    ATTENTION_PRESETS,
    check_section,
    make_sparsity_config,
    resolve_attention,
)
from lightning_zero.sparse_attention.sparse_self_attention import SparseSelfAttention
from lightning_zero.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from lightning_zero.sparse_attention.utils import SparseAttentionUtils

__all__ = [
    "ATTENTION_CHOICES",
    "ATTENTION_PRESETS",
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "check_section",
    "make_sparsity_config",
    "resolve_attention",
]
