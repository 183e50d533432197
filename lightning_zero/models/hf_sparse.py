"""Block-sparse attention in a Hugging Face ``transformers`` model: the attention function and its mask
function registered under one name (Note [HF masks] in ``lightning_zero/sparse_attention/utils.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_zero.sparse_attention.sparsity_config import SparsityConfig
from lightning_zero.sparse_attention.utils import SparseAttentionUtils


def register_hf_sparse_attention(sparsity_config: SparsityConfig, max_position: int, name: str = "sparse",
                                 executor: str = "auto") -> Callable[..., Any]:
    """Register sparse attention with ``transformers`` as ``name``; select it with
    ``model.set_attn_implementation(name)`` or ``from_config(config, attn_implementation=name)``.

    Args:
        sparsity_config: the layout (its ``num_heads`` the model's attention heads).
        max_position: the longest sequence the model will see (padded up to the block inside).
        name: the implementation's name.
        executor: ``SparseSelfAttention``'s executor.

    Returns:
        The attention function registered.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:  # transformers is optional (the dev extra has it)
        raise ImportError("register_hf_sparse_attention needs transformers >= 5 (AttentionMaskInterface): "
                          "pip install 'transformers>=5'") from err
    function = SparseAttentionUtils.hf_attention_function(sparsity_config, max_position, executor=executor)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)  # SDPA's boolean 4-D mask (None when causal, no padding)
    return function
