"""``SparseAttentionUtils``: padding a batch to a multiple of the block and back (DeepSpeed's names),
putting ``SparseSelfAttention`` into a model, and a Hugging Face attention function.

Note [HF masks]: transformers (5.x) builds the 4-D mask it hands an attention function with the mask
function registered under the same name in ``AttentionMaskInterface``; a name registered only in
``AttentionInterface`` gets ``attention_mask=None``, padding included. The registration helper
(``lightning_zero.models.hf_sparse``, a layer above: this one imports torch only) registers both, the mask
as SDPA's boolean one.

Note [attention slot]: a model opts in by giving its attention modules a ``sparse_attention``
attribute (``None`` while dense) and its head count as ``n_head`` or ``num_heads``;
:meth:`SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention` fills every such
slot, and the module runs ``sparse_attention(q, k, v)`` instead of its dense attention. The GPT
experiment (``lightning_zero/models/gpt.py``) has the slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.sparse_attention.sparse_self_attention import SparseSelfAttention
from lightning_zero.sparse_attention.sparsity_config import SparsityConfig


class SparseAttentionUtils:
    """DeepSpeed's helpers, for models with an attention slot (Note [attention slot]) and for HF models."""

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                          token_type_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int,
                          model_embeddings: Callable[[torch.Tensor], torch.Tensor] | None
                          ) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pad the sequence dimension to a multiple of ``block_size``: ids with ``pad_token_id``, the
        attention mask with 0 (the padding is not attended to), token types with 0, positions with
        ``pad_token_id``, embeddings with the embedding of ``pad_token_id``. Returns ``pad_len`` and the
        padded tensors (``None`` stays ``None``); undo with :meth:`unpad_sequence_output`."""
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None:
            raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
        batch, seq_len = reference.shape[:2]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            if model_embeddings is None:
                raise ValueError("padding inputs_embeds needs model_embeddings (the model's token embedding)")
            pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
        if input_ids is not None:
            input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
        if position_ids is not None:
            position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
        if attention_mask is not None:
            attention_mask = F.pad(attention_mask, (0, pad_len), value=0)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Drop the ``pad_len`` positions :meth:`pad_to_block_size` added."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
            model: nn.Module, max_position: int, sparsity_config: SparsityConfig, causal: bool = True,
            executor: str = "auto") -> nn.Module:
        """Fill every attention slot of ``model`` (Note [attention slot]) with a
        :class:`SparseSelfAttention` for ``max_position`` tokens; ``ValueError`` if there is none or a
        slot's head count differs from ``sparsity_config.num_heads``."""
        slots = [(name, m) for name, m in model.named_modules() if hasattr(m, "sparse_attention")]
        if not slots:
            raise ValueError(f"{type(model).__name__} has no attention module with a `sparse_attention` slot "
                             "(see Note [attention slot] in lightning_zero/sparse_attention/utils.py); for a "
                             "Hugging Face model use SparseAttentionUtils.hf_attention_function")
        block = sparsity_config.block
        padded = -(-max_position // block) * block
        for name, module in slots:
            heads = getattr(module, "n_head", getattr(module, "num_heads", None))
            if heads != sparsity_config.num_heads:
                raise ValueError(f"{name} has {heads} heads, the sparsity config {sparsity_config.num_heads}")
            module.sparse_attention = SparseSelfAttention(sparsity_config, max_seq_length=padded, causal=causal,
                                                          executor=executor)
        return model

    @staticmethod
    def hf_attention_function(sparsity_config: SparsityConfig, max_position: int,
                              executor: str = "auto") -> Callable[..., tuple[torch.Tensor, None]]:
        """An attention function with Hugging Face's interface: ``fn(module, query, key, value,
        attention_mask, scaling=None, dropout=0.0, **kwargs)`` with ``(batch, heads, seq, head_dim)`` inputs,
        returning the output as ``(batch, seq, heads, head_dim)`` and no weights. Register it with
        :func:`lightning_zero.models.hf_sparse.register_hf_sparse_attention`, which also registers the mask
        function (registered alone through ``AttentionInterface``, transformers passes it no mask at all, so
        padding would be ignored: Note [HF masks]). The module's ``is_causal`` picks causal attention; HF's
        4-D mask (boolean, True attends, or additive; one per batch row or one for all) is added to the
        scores; fewer key / value heads than query heads (grouped-query attention) are repeated to the query
        heads, as HF's eager attention does. Sequences not a multiple of the block are padded at the end
        (padded keys hidden) and cut back. A query shorter than its keys (generation with a KV cache) is
        refused."""
        block = sparsity_config.block
        layers: dict[bool, SparseSelfAttention] = {}
        padded_max = -(-max_position // block) * block

        def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
            if dropout and module.training:
                raise ValueError("sparse attention has no attention dropout: set the model's attention_dropout=0")
            if key.shape[-2] != query.shape[-2]:
                raise ValueError(f"a query of {query.shape[-2]} tokens against {key.shape[-2]} keys (generation with "
                                 "a KV cache) is not supported by sparse attention: generate with use_cache=False, "
                                 "or with the model's dense attention")
            heads, kv_heads = query.shape[1], key.shape[1]
            if heads % kv_heads:
                raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key / value heads")
            if kv_heads != heads:  # grouped-query attention: each key / value head serves heads / kv_heads queries
                key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
            if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
                raise ValueError(f"sparse attention scales scores by head_dim**-0.5, the model asks {scaling}")
            causal = bool(getattr(module, "is_causal", False))
            if causal not in layers:
                layers[causal] = SparseSelfAttention(sparsity_config, max_seq_length=padded_max, causal=causal,
                                                     executor=executor).to(query.device)
            length = query.shape[-2]
            pad = (block - length % block) % block
            acc = torch.float64 if query.dtype == torch.float64 else torch.float32
            mask = None if attention_mask is None else _additive_hf_mask(attention_mask, length, acc)
            if pad:
                query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
                rows = 1 if mask is None else mask.shape[0]
                base = torch.zeros(rows, 1, length + pad, length + pad, dtype=acc, device=query.device)
                base[..., length:] = float("-inf")  # padded keys are never attended to
                base[..., length:, :] = 0.0  # padded queries see everything (their rows are cut off)
                if mask is not None:
                    base[..., :length, :length] = mask
                mask = base
            # the mask goes in as a constant additive score term (``rpe``): it may differ per batch row
            out = layers[causal](query, key, value, rpe=mask)
            return out[:, :, :length].transpose(1, 2).contiguous(), None

        return attention


def _additive_hf_mask(mask: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """HF's 4-D attention mask ``(batch or 1, 1, q, k)`` as an additive ``(batch or 1, 1, length, length)``
    term: boolean True attends (0), False hides (-inf); an additive mask as it is."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected Hugging Face's 4-D attention mask (batch, 1, q, k), got {tuple(mask.shape)}")
    mask = mask[..., :length, :length]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)
