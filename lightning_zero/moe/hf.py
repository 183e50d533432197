"""Hugging Face MoE models under expert parallelism, found from the model's own ``base_model_ep_plan``.

Note [Hugging Face experts]
    transformers 5 stores a MoE block's experts as one module with 3-D parameters (``gate_up_proj``
    [E, 2I, H], ``down_proj`` [E, H, I], optional ``*_bias`` [E, ...]) whose forward takes
    ``(hidden_states, top_k_index, top_k_weights)`` from the block's own router; the config's
    ``base_model_ep_plan`` names them (``"layers.*.mlp.experts": "ep_dispatch_experts"``, the parameters
    ``"grouped_gemm"``). Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3 carry it. The plan is found on the module,
    as the tensor-parallel plan is (an ``PreTrainedModel`` among the LightningModule's submodules, its keys
    prefixed with its name and its ``base_model_prefix``). Each planned experts module keeps its class, names
    and router; it gets this rank's experts (Note [expert split] in experts.py) and, on the instance, a
    forward that dispatches the tokens to the ranks of their experts (Note [expert dispatch]) and computes the
    local ones as grouped products with the module's own gating (``_apply_gate`` / ``act_fn``), weight layout
    (``is_transposed``) and biases. The router, the auxiliary loss (the model's ``load_balancing_loss_func``
    over its router logits) and everything else stay as the model defines them. Routing is dropless, as the
    models' own forwards are.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_zero.moe.dispatch import ExpertGroup, dispatch_and_combine
from lightning_zero.moe.experts import expert_parameter_names, split_experts
from lightning_zero.moe.grouped import grouped_matmul, rows_bias
from lightning_zero.moe.stats import RouterStats

DISPATCH_STYLE = "ep_dispatch_experts"
KNOWN_STYLES = (DISPATCH_STYLE, "grouped_gemm")


def hf_ep_plan(root: nn.Module) -> dict[str, str]:
    """The expert-parallel plans of the Hugging Face models among ``root``'s submodules, keys prefixed with the
    submodule's name (and its base model's prefix), as :func:`~lightning_zero.tensor_parallel.plan.hf_plan` reads
    tensor-parallel plans."""
    plan: dict[str, str] = {}
    for prefix, module in root.named_modules():
        if not hasattr(module, "base_model_prefix"):
            continue
        config = getattr(module, "config", None)
        base = getattr(config, "base_model_ep_plan", None) if config is not None else None
        if not base:
            continue
        base_prefix = getattr(module, "base_model_prefix", "")
        inner = f"{base_prefix}." if base_prefix and hasattr(module, base_prefix) else ""
        for key, style in base.items():
            plan.setdefault(f"{prefix}.{inner}{key}" if prefix else f"{inner}{key}", style)
    return plan


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + "$")


def hf_expert_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules a Hugging Face ``base_model_ep_plan`` names ``ep_dispatch_experts``, in module order.

    Raises:
        ValueError: a plan style this adapter does not know, or a planned module without 3-D expert weights.
    """
    plan = hf_ep_plan(root)
    for key, style in plan.items():
        if style not in KNOWN_STYLES:
            raise ValueError(f"base_model_ep_plan entry {key!r}: {style!r} is not built (known: {KNOWN_STYLES})")
    patterns = [_pattern(k) for k, s in plan.items() if s == DISPATCH_STYLE]
    found = [(n, m) for n, m in root.named_modules() if n and any(p.match(n) for p in patterns)]
    for name, module in found:
        if num_experts_of(module) is None:
            raise ValueError(f"{name} ({type(module).__name__}) is planned for expert dispatch but holds no "
                             "3-D expert weights (gate_up_proj / up_proj and down_proj)")
    return found


def num_experts_of(module: nn.Module) -> int | None:
    """E of a Hugging Face experts module, or ``None`` when it is not one."""
    down = getattr(module, "down_proj", None)
    if not isinstance(down, torch.Tensor) or down.dim() != 3:
        return None
    return int(getattr(module, "num_experts", down.shape[0]))


def attach_hf_experts(module: nn.Module, ep: ExpertGroup,
                      memo: dict[nn.Parameter, nn.Parameter] | None = None) -> list[nn.Parameter]:
    """Split a Hugging Face experts module over ``ep`` and give the instance the dispatching forward (Note
    [Hugging Face experts]); returns its expert parameters' slices."""
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"{type(module).__name__} normalises each expert's output (has_post_expert_norm): "
                                  "not built under expert parallelism")
    if getattr(module, "is_concatenated", True) is False and not hasattr(module, "_apply_gate"):
        raise NotImplementedError(f"{type(module).__name__}: interleaved gate/up weights without _apply_gate")
    num = num_experts_of(module)
    assert num is not None
    parts = split_experts(module, expert_parameter_names(module, num), ep, num, memo)
    module.expert_group = ep
    module.router_stats = RouterStats(num)
    module.forward = types.MethodType(_dispatching_forward(num), module)
    return parts


def detach_hf_experts(module: nn.Module) -> None:
    """The class's own forward again (the parameters stay this rank's slices)."""
    module.__dict__.pop("forward", None)
    module.__dict__.pop("expert_group", None)


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    w = getattr(module, name)
    return w.transpose(-2, -1) if getattr(module, "is_transposed", False) else w


def _local_compute(module: nn.Module) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    gated = hasattr(module, "gate_up_proj")
    up_name = "gate_up_proj" if gated else "up_proj"
    has_bias = bool(getattr(module, "has_bias", False))

    def compute(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        up = _weight(module, up_name)
        h = grouped_matmul(rows.to(up.dtype), up, counts)
        if has_bias:
            h = h + rows_bias(getattr(module, f"{up_name}_bias"), counts)
        if gated:
            h = module._apply_gate(h) if hasattr(module, "_apply_gate") else _gate(module, h)
        else:
            h = module.act_fn(h)
        y = grouped_matmul(h, _weight(module, "down_proj"), counts)
        if has_bias:
            y = y + rows_bias(module.down_proj_bias, counts)
        return y

    return compute


def _gate(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _dispatching_forward(num_experts: int) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counts = torch.bincount(top_k_index.reshape(-1), minlength=num_experts)
        self.router_stats.record(counts, 0, None, None)
        out = dispatch_and_combine(hidden_states, top_k_index, top_k_weights, None, num_experts,
                                   _local_compute(self), self.expert_group)
        return out.to(hidden_states.dtype)

    return forward
