"""The FlexAttention executor: ``torch.nn.attention.flex_attention`` compiled, with a block mask made
from the layout, where it runs (CUDA, forward and backward; CPU, forward only: its backward raises
there). Exact like the block-sparse kernel: the layout is an element-wise ``mask_mod``, the masks a
``score_mod``."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.sparse_attention.block_sparse import Masks

_COMPILED: dict[str, Any] = {}


def flex_available() -> bool:
    """Whether this torch has FlexAttention."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_runs(q: torch.Tensor, needs_grad: bool) -> bool:
    """Whether FlexAttention can run this call: on CUDA always, on CPU only without a backward and in
    float32 / float16 / bfloat16 (its CPU kernel has no float64)."""
    return flex_available() and (q.is_cuda or (q.device.type == "cpu" and not needs_grad
                                               and q.dtype != torch.float64))


def _compiled_flex() -> Any:
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def make_block_mask(layout: torch.Tensor, block: int, length: int, causal: bool, device: torch.device) -> Any:
    """FlexAttention's ``BlockMask`` of a ``(heads, blocks, blocks)`` layout over ``length`` tokens."""
    from torch.nn.attention.flex_attention import create_block_mask

    allowed = layout.bool().to(device)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = allowed[h, q_idx // block, kv_idx // block]
        return keep & (kv_idx <= q_idx) if causal else keep

    return create_block_mask(mask_mod, B=None, H=layout.shape[0], Q_LEN=length, KV_LEN=length, device=device)


def flex_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float,
                          masks: Masks) -> torch.Tensor:
    """Attention of ``(batch, heads, L, head_dim)`` tensors through compiled FlexAttention."""
    kp, am, rpe = masks.key_padding, masks.attn, masks.rpe
    score_mod = None
    if kp is not None or am is not None or rpe is not None:
        if rpe is not None:
            rpe = rpe.reshape((1,) * (4 - rpe.dim()) + tuple(rpe.shape))
        rpe_b, rpe_h = (rpe.shape[0] > 1, rpe.shape[1] > 1) if rpe is not None else (False, False)
        kp_b = kp is not None and kp.shape[0] > 1

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if kp is not None:
                score = score + kp[b if kp_b else 0, kv_idx].to(score.dtype)
            if am is not None:
                score = score + am[q_idx, kv_idx].to(score.dtype)
            if rpe is not None:
                score = score + rpe[b if rpe_b else 0, h if rpe_h else 0, q_idx, kv_idx].to(score.dtype)
            return score

    return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
