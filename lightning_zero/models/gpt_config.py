"""The GPT's shape: ``GPTConfig``, the named presets ``GPT_PRESETS`` and ``resolve_config``.

Plain dataclasses, no torch: the command line's checks and the memory estimator read a preset's shape here
(``lightning_zero.models.gpt`` builds it; its public names include these).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class GPTMoE:
    """The GPT's mixture-of-experts option: every block's MLP becomes ``num_experts`` expert MLPs (GELU, no bias,
    ``intermediate_size`` wide, default 4 x n_embd) behind a top-k router (docs/expert_parallel.md).

    Args:
        num_experts: E (0: the dense MLP).
        top_k: experts per token.
        capacity_factor: training capacity factor; ``None``: dropless (Note [token-choice routing] in
            moe/routing.py).
        eval_capacity_factor: the same outside training (``None``: dropless).
        min_capacity: the least capacity of an expert when dropping.
        aux_loss_coef: the load-balancing loss's weight in the training loss (summed over the blocks).
        z_loss_coef: the router z-loss's weight.
        intermediate_size: each expert's hidden width (``None``: 4 x n_embd).
    """

    num_experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    min_capacity: int = 0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    intermediate_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"model.moe.num_experts must be a non-negative integer, got {self.num_experts!r}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model.moe.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError("model.moe.aux_loss_coef and z_loss_coef must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. ``seq_len`` is the maximum context (size of the position embedding)."""

    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    # a DeepSpeed ``sparse_attention`` section (``mode`` + keys, docs/sparse_attention.md); None: dense SDPA
    sparse_attention: dict[str, Any] | None = None
    # mixture of experts (a GPTMoE, or its fields as a dict); None: dense MLPs
    moe: GPTMoE | None = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = GPTMoE(**self.moe)
        if self.moe is not None and not self.moe.enabled:
            self.moe = None


# Parameter counts (tied weights, vocab 256) are listed in the comments; see tests/unit/test_experiments.py.
GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt_tiny": GPTConfig(seq_len=64, n_layer=2, n_head=4, n_embd=64),  # 0.12M
    "gpt_1m": GPTConfig(seq_len=256, n_layer=5, n_head=4, n_embd=128),  # 1.06M
    "gpt_small": GPTConfig(seq_len=256, n_layer=8, n_head=8, n_embd=256),  # 6.4M
    "gpt_20m": GPTConfig(seq_len=512, n_layer=12, n_head=6, n_embd=384),  # 21.6M
    "gpt_50m": GPTConfig(seq_len=1024, n_layer=16, n_head=8, n_embd=512),  # 51.1M
    "gpt_125m": GPTConfig(seq_len=1024, n_layer=18, n_head=12, n_embd=768),  # 128.6M
    "gpt_350m": GPTConfig(seq_len=1024, n_layer=28, n_head=16, n_embd=1024),  # 354.0M
    "gpt_1b": GPTConfig(seq_len=1024, n_layer=20, n_head=16, n_embd=2048),  # 1.01B
}


def resolve_config(model: GPTConfig | str | dict[str, Any], overrides: dict[str, Any] | None = None) -> GPTConfig:
    """A :class:`GPTConfig` from a preset name, a config or a plain dict, with optional field overrides."""
    if isinstance(model, str):
        if model not in GPT_PRESETS:
            raise KeyError(f"unknown GPT preset {model!r}; choose from {sorted(GPT_PRESETS)}")
        config = GPT_PRESETS[model]
    elif isinstance(model, GPTConfig):
        config = model
    else:
        config = GPTConfig(**dict(model))
    return replace(config, **(overrides or {}))
