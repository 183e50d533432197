"""The GPT's shape: ``GPTConfig``, the named presets ``GPT_PRESETS`` and ``resolve_config``.

Plain dataclasses, no torch: the command line's checks and the memory estimator read a preset's shape here
(``lightning_zero.models.gpt`` builds it; its public names include these).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


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
