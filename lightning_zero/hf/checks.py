"""What ``model=hf_causal_lm`` needs, checked before any rank starts from the files alone (``transformers`` is imported
only to read a tensor-parallel plan): the directory or config, a tokenizer for text data, the context length,
and the parallel dimensions, each refused with its reason where the model has no plan for it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_zero.hf.directory import CONFIG_FILE, HFDirectory

# config.json keys of the same quantity across architectures (transformers' attribute_map does this per class)
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
_HEADS = ("num_attention_heads", "n_head")
_ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


@dataclass(frozen=True)
class HFRun:
    """The parts of a run that matter to a Hugging Face model's checks."""

    path: str | None
    config: Any
    tokenizer: str | None  # model.tokenizer or data.tokenizer
    text_data: bool  # the package's text data (tokenized with the model's tokenizer)
    seq_len: int | None
    shards_parameters: bool  # ZeRO stage 3
    tensor: int
    sequence: int
    pipeline: int
    sparse: bool  # model.attention is block-sparse


def _first(config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), None)


def _config_data(run: HFRun) -> dict[str, Any] | None:
    """``config.json`` as plain data (``None`` when it cannot be read without transformers)."""
    if run.path:
        file = Path(run.path) / CONFIG_FILE
    elif isinstance(run.config, Mapping):
        return dict(run.config)
    elif isinstance(run.config, str):
        file = Path(run.config) / CONFIG_FILE if Path(run.config).is_dir() else Path(run.config)
    else:
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def hf_problems(run: HFRun) -> list[str]:
    """Every reason ``run`` cannot work, each with its fix (empty when none)."""
    if (run.path is None) == (run.config is None):
        return ["model=hf_causal_lm needs exactly one of model.path (a directory save_pretrained wrote) and "
                "model.config (a config.json, or {model_type: llama, ...}: random weights)."]
    out = HFDirectory(Path(run.path)).problems() if run.path else []
    if isinstance(run.config, str) and not Path(run.config).exists():
        out.append(f"model.config={run.config} does not exist. Fix: a config.json, a directory holding one, or a "
                   "mapping with model_type.")
    if out:
        return out
    if run.text_data:
        tokenizer = run.tokenizer or run.path
        if tokenizer is None or not HFDirectory(Path(tokenizer)).tokenizer_files():
            out.append(f"text data with model=hf_causal_lm is tokenized with the model's tokenizer, and "
                       f"{tokenizer or 'model.config'} has none (tokenizer.json / tokenizer_config.json). Fix: "
                       "model.tokenizer=DIR (a directory `tokenizer.save_pretrained(dir)` wrote).")
    config = _config_data(run) or {}
    positions = _first(config, _POSITIONS)
    if run.seq_len is not None and positions is not None and run.seq_len > positions:
        out.append(f"data.seq_len={run.seq_len} exceeds the model's context ({positions} positions). Fix: "
                   f"data.seq_len={positions} or less.")
    if run.sparse and _first(config, _ATTENTION_DROPOUT):
        out.append(f"model.attention (block-sparse) has no attention dropout, and the model's config sets "
                   f"{next(k for k in _ATTENTION_DROPOUT if config.get(k))}={_first(config, _ATTENTION_DROPOUT)}. "
                   "Fix: set it to 0 in config.json, or model.attention=dense.")
    if run.pipeline > 1:
        out.append("pipeline with model=hf_causal_lm is not built: a transformers model does not follow the pipeline "
                   "protocol (pipeline_layers / pipeline_loss, docs/pipeline.md). Fix: pipeline=none.")
    if run.sequence > 1:
        out.append("sequence_parallel with model=hf_causal_lm is not built: the model's attention is not wrapped "
                   "in the Ulysses all-to-alls and it has no configure_sequence_parallel (docs/sequence_parallel.md). "
                   "Fix: sequence_parallel=none.")
    if run.tensor > 1:
        out += _tensor_problems(run, config)
    return out


def _tensor_problems(run: HFRun, config: Mapping[str, Any]) -> list[str]:
    if run.shards_parameters:
        return ["tensor_parallel with model=hf_causal_lm at zero.stage=3 is not built yet: stage 3 builds the model "
                "on the meta device and streams the weights into the shards, and the plan slices whole built layers "
                "(Note [slice after build]). Fix: zero=stage2 (or lower) with tensor_parallel, or "
                "tensor_parallel=none."]
    from transformers import AutoConfig

    model_type = config.get("model_type")
    try:
        plan = getattr(AutoConfig.for_model(model_type), "base_model_tp_plan", None) if model_type else None
    except ValueError:  # a model_type transformers does not know: from_pretrained says so on the ranks
        return []
    if not plan:
        return [f"tensor_parallel with model=hf_causal_lm: {model_type} has no tensor-parallel plan in transformers "
                "(its config's base_model_tp_plan), so nothing says how to split its layers. Fix: "
                "tensor_parallel=none, or an architecture with a plan (llama, qwen2, mistral, ...)."]
    out = []
    heads = _first(config, _HEADS)
    for what, count in (("attention heads", heads), ("key / value heads", config.get("num_key_value_heads", heads))):
        if count is not None and count % run.tensor:
            out.append(f"tensor_parallel.size={run.tensor} does not divide the model's {count} {what}. Fix: a size "
                       f"dividing {count}.")
    return out
