"""Block-sparse attention (issue 32): DeepSpeed's sparsity configs and their layouts,
``SparseSelfAttention`` with an exact pure-torch block-sparse kernel (CPU training) and FlexAttention
(CUDA training, inference), and the helpers that put it into a model. docs/sparse_attention.md."""

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

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
]
