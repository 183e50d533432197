"""A DeepSpeed JSON ``sparse_attention`` section (``mode`` and that mode's keys) as a sparsity config,
and the named sections behind ``model.attention=sparse_fixed`` and its siblings.

DeepSpeed reads the section in ``runtime/config.py``: ``mode`` picks the class (``dense``, ``fixed``,
``variable``, ``bigbird``, ``bslongformer``; default ``fixed``), and the other keys are that class's
constructor arguments. We add ``local_sliding_window`` (DeepSpeed has the class but no mode for it),
``seed`` (random blocks: Note [same layout on every rank]) and ``executor`` (Note [executor choice]).
A key the mode does not take is refused, naming the keys it does take.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from lightning_zero.sparse_attention.sparse_self_attention import EXECUTORS
from lightning_zero.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

MODES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig, "fixed": FixedSparsityConfig, "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig, "bslongformer": BSLongformerSparsityConfig,
    "local_sliding_window": LocalSlidingWindowSparsityConfig,
}
EXTRA_KEYS = ("mode", "executor")  # the section's keys that are no constructor argument

# ``model.attention=<name>``: the sections a decoder (unidirectional) trains with out of the box
ATTENTION_PRESETS: dict[str, dict[str, Any]] = {
    "sparse_fixed": {"mode": "fixed", "block": 16, "num_local_blocks": 4, "num_global_blocks": 1,
                     "attention": "unidirectional"},
    "sparse_variable": {"mode": "variable", "block": 16, "num_random_blocks": 1, "local_window_blocks": [4],
                        "global_block_indices": [0], "attention": "unidirectional", "seed": 0},
    "sparse_bigbird": {"mode": "bigbird", "block": 16, "num_random_blocks": 1, "num_sliding_window_blocks": 3,
                       "num_global_blocks": 1, "attention": "unidirectional", "seed": 0},
    "sparse_bslongformer": {"mode": "bslongformer", "block": 16, "num_sliding_window_blocks": 3,
                            "global_block_indices": [0], "attention": "unidirectional"},
    "sparse_local": {"mode": "local_sliding_window", "block": 16, "num_sliding_window_blocks": 3,
                     "attention": "unidirectional"},
    "sparse_dense": {"mode": "dense", "block": 16},
}
ATTENTION_CHOICES = ("dense", *ATTENTION_PRESETS)


def _arguments(cls: type[SparsityConfig]) -> list[str]:
    return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "num_heads")]


def check_section(section: Mapping[str, Any], where: str = "sparse_attention") -> dict[str, Any]:
    """The section as a plain dict, its mode and keys checked (``ValueError`` naming the fix)."""
    if not isinstance(section, Mapping):
        raise ValueError(f"`{where}` must be a mapping of DeepSpeed sparse-attention keys, got {section!r}")
    section = dict(section)
    mode = section.get("mode", "fixed")
    if mode not in MODES:
        raise ValueError(f"`{where}.mode`={mode!r}: choose one of {sorted(MODES)}")
    allowed = _arguments(MODES[mode])
    unknown = sorted(k for k in section if k not in allowed and k not in EXTRA_KEYS)
    if unknown:
        raise ValueError(f"`{where}` in mode {mode!r} does not take {unknown}; its keys are "
                         f"{sorted([*allowed, *EXTRA_KEYS])}")
    if section.get("executor", "auto") not in EXECUTORS:
        raise ValueError(f"`{where}.executor`={section['executor']!r}: choose one of {EXECUTORS}")
    make_sparsity_config(section, num_heads=1)  # the class's own argument checks, now rather than at build
    return section


def make_sparsity_config(section: Mapping[str, Any], num_heads: int) -> SparsityConfig:
    """The sparsity config of a (checked) section for a layer with ``num_heads`` heads."""
    mode = section.get("mode", "fixed")
    kwargs = {k: v for k, v in section.items() if k not in EXTRA_KEYS}
    if "seed" in _arguments(MODES[mode]):
        kwargs.setdefault("seed", 0)  # Note [same layout on every rank]
    return MODES[mode](num_heads=num_heads, **kwargs)


def resolve_attention(attention: str, section: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The sparse-attention section of ``model.attention`` (a preset name or ``dense``) with the keys
    of ``section`` (``model.sparse_attention`` / a JSON's ``sparse_attention``) over it; ``None``: dense."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"model.attention={attention!r}: choose one of {list(ATTENTION_CHOICES)}")
    if attention == "dense" and not section:
        return None
    base = dict(ATTENTION_PRESETS.get(attention, {}))
    if section and base and section.get("mode", base["mode"]) != base["mode"]:
        raise ValueError(f"model.attention={attention} is mode {base['mode']!r}, but the sparse_attention "
                         f"section says mode {section['mode']!r}: set one of them")
    merged = {**base, **dict(section or {})}
    return check_section(merged)


def dense_at(section: Mapping[str, Any], num_heads: int, seq_len: int) -> bool:
    """Whether the (checked) section's layout at ``seq_len`` tokens (padded to whole blocks) keeps every block a
    causal query sees: then it computes what dense attention computes, through the slower sparse path.

    Raises:
        ValueError: the pattern does not fit ``seq_len`` (e.g. a window of more blocks than the sequence has).
    """
    config = make_sparsity_config(section, num_heads)
    blocks = -(-seq_len // config.block)
    seen = torch.tril(torch.ones(blocks, blocks, dtype=torch.bool))
    layout = config.make_layout(blocks * config.block).bool()
    return bool((layout | ~seen).all())


def sparse_from(section: Mapping[str, Any], num_heads: int, limit: int = 1 << 16) -> int | None:
    """The shortest length (in whole blocks, at most ``limit`` tokens) at which the section's layout is not
    dense (:func:`dense_at`); ``None`` when it is dense up to ``limit`` (e.g. ``mode: dense``)."""
    block = make_sparsity_config(section, num_heads).block
    for tokens in range(block, limit + 1, block):
        try:
            if not dense_at(section, num_heads, tokens):
                return tokens
        except ValueError:  # too few blocks for this pattern's windows
            continue
    return None
