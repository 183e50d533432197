"""What the launcher says about a composed config before any rank starts: the ``offload/`` option the devices
amount to, the model's parameters counted on the meta device (never materialised), the run's choices beside their
defaults, and the one-paragraph description."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_zero.config.model_zoo import build_module, gpt_config
from lightning_zero.config.schema import (
    GPTModelSchema,
    HFCausalLMSchema,
    MLPModelSchema,
    ModelSchema,
    TextDataSchema,
    TrainConfig,
)
from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.project.targets import TargetNode


def offload_name(cfg: TrainConfig) -> str:
    """The ``offload/`` option the devices amount to (``none``, ``optimizer_cpu``, ``param_nvme``, ...)."""
    opt, par = cfg.offload.optimizer_device, cfg.offload.param_device
    if par is not OffloadDevice.none:
        return f"param_{par.value}"
    return "none" if opt is OffloadDevice.none else f"optimizer_{opt.value}"


def count_model_parameters(cfg: TrainConfig) -> int | None:
    """Parameters of the configured model, counted on the meta device (nothing is allocated); a Hugging Face
    checkpoint's from its files' headers; ``None`` where counting would import the user's code or ``transformers``
    (a ``_target_`` model, ``model.config`` without weights)."""
    if isinstance(cfg.model, TargetNode):
        return None
    if isinstance(cfg.model, HFCausalLMSchema):
        from lightning_zero.hf.directory import HFDirectory

        return HFDirectory(Path(cfg.model.path)).num_parameters() if cfg.model.path else None
    if isinstance(cfg.model, GPTModelSchema):
        from lightning_zero.models.gpt_model import count_parameters

        return count_parameters(gpt_config(cfg.model))
    if isinstance(cfg.model, MLPModelSchema):  # its layers alone: the launcher counts without Lightning
        from lightning_zero.models.mlp_parts import mlp_layers

        m = cfg.model
        with torch.device("meta"):
            layers = mlp_layers(m.input_dim, m.hidden_dim, m.num_layers, m.num_classes)
        return sum(p.numel() for module in layers for p in module.parameters())
    with torch.device("meta"):
        module = build_module(cfg)
    return sum(p.numel() for p in module.parameters())


DEFAULT_CHOICES: dict[str, Any] = {"pipeline": "none", "tensor_parallel": 1, "sequence_parallel": 1,
                                   "expert_parallel": 1, "attention": "dense", "optimizer": "adamw"}


def run_choices(cfg: TrainConfig) -> dict[str, Any]:
    """What a run is beyond its model and data: ZeRO stage, precision, offload and the dimensions of
    :data:`DEFAULT_CHOICES` (pipeline, tensor, sequence and expert parallel, attention, optimizer), as the header line
    (:func:`describe`), TensorBoard's HParams (``build.run_hparams``) and the run directory (``paths.run_name``)
    name them."""
    m, p = cfg.model, cfg.pipeline
    name, section = getattr(m, "attention", "dense"), getattr(m, "sparse_attention", None)  # GPT, HF causal LM
    attention = name if name != "dense" or not section else f"sparse_{section.get('mode', 'fixed')}"
    out = {"zero_stage": cfg.zero.stage, "precision": cfg.precision.name.value, "offload": offload_name(cfg),
           "pipeline": "none" if p.stages <= 1 else f"{p.stages} stages, {p.schedule.value}",
           "tensor_parallel": cfg.tensor_parallel.size, "sequence_parallel": cfg.sequence_parallel.size,
           "expert_parallel": cfg.expert_parallel.size, "attention": attention}
    if isinstance(m, ModelSchema):  # a `_target_` model's optimizer is its own
        out["optimizer"] = m.optimizer.value
    return out


def describe(cfg: TrainConfig) -> str:
    """One line naming the run: model (size counted on meta), data, ZeRO stage, precision, offload, every other
    dimension that is not the default (:func:`run_choices`), and ranks."""
    m, d, t = cfg.model, cfg.data, cfg.trainer
    model = m.preset if isinstance(m, GPTModelSchema) else m.target if isinstance(m, TargetNode) else \
        f"{m.kind} {m.path or 'from model.config'}" if isinstance(m, HFCausalLMSchema) else m.kind
    data = d.target if isinstance(d, TargetNode) else d.kind if not isinstance(d, TextDataSchema) else (
        "synthetic" if d.synthetic else (d.path or "python-stdlib"))
    params = count_model_parameters(cfg)
    size = "" if params is None else f" ({params / 1e6:.2f}M params)"
    choices = run_choices(cfg)
    others = "".join(f"{key.replace('_', ' ')} {choices[key]}, " for key, off in DEFAULT_CHOICES.items()
                     if choices.get(key, off) != off)
    return (f"{cfg.name}: {model}{size} on {data}; ZeRO stage "
            f"{cfg.zero.stage}, {cfg.precision.name.value}, offload={offload_name(cfg)}, {others}"
            f"{t.devices} x {t.accelerator}")
