"""What the estimate knows about a model: :class:`ModelSpec` from a preset, a module or an import path.

Presets are well-known architectures (:data:`PRESETS`, counted from their formulas) and this
repository's GPT presets (:data:`lightning_zero.models.gpt.GPT_PRESETS`, built on the meta device). A
model's tensor-parallel plan, when it has one, says which parameters tensor parallelism keeps whole.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_zero.models.gpt_config import GPT_PRESETS


@dataclass(frozen=True)
class ModelSpec:
    """What the estimate knows about the model. Unknown fields are ``None``.

    Args:
        num_params: Ψ, trainable parameters (frozen ones are not counted).
        name: preset name or import path it came from.
        layers, hidden, heads, seq_len: transformer shape, for activation memory.
        largest_layer_params: parameters of the largest single module (its own, not its
            children's): the layer stage 3 must gather whole.
        replicated_params: of ``num_params``, those tensor parallelism keeps whole on every rank
            (norms, biases added after a row-parallel sum, position embeddings); the rest it splits.
            ``None``: unknown, taken as 0 (every parameter split).
        largest_replicated_layer_params: the largest module tensor parallelism keeps whole (``None``:
            unknown, taken as 0: the largest layer is split).
        unit_params: the largest stage-3 unit (a block: Note [units] in ``core/stage3/units.py``), without its
            parameters below the persistence threshold; ``None``: unknown.
        root_params: parameters in no block (embeddings, final norm, head), gathered whole through a step.
        persistent_params: parameters below the persistence threshold (100k), kept whole by every rank.
        unit_param_sizes: the sizes of the largest unit's parameters in module order (how its gradients are
            bucketed); ``None``: unknown.
        expert_params: of ``num_params``, the MoE layers' expert parameters (all experts; ``None``: a dense model).
        num_experts, top_k, moe_layers: E per MoE layer, experts per token, MoE layers (for the all-to-all bytes).
    """

    num_params: float
    name: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    largest_layer_params: float | None = None
    replicated_params: float | None = None
    largest_replicated_layer_params: float | None = None
    unit_params: float | None = None
    root_params: float | None = None
    persistent_params: float | None = None
    unit_param_sizes: tuple[int, ...] | None = None
    expert_params: float | None = None
    num_experts: int | None = None
    top_k: int | None = None
    moe_layers: int | None = None

    def rank_params(self, tensor_parallel: int) -> float:
        """Parameters one tensor-parallel rank holds: ``Ψ_split / tp + Ψ_rep`` (Note [model state with TP])."""
        rep = self.replicated_params or 0.0
        return (self.num_params - rep) / tensor_parallel + rep

    def rank_largest_layer(self, tensor_parallel: int, expert_parallel: int = 1) -> float:
        """The largest layer one tensor-parallel rank holds: a split layer's slice or a replicated layer whole; with
        expert parallelism an experts module (the largest layer of a MoE) counts this rank's experts only."""
        largest = max((self.largest_layer_params or 0.0) / tensor_parallel, self.largest_replicated_layer_params or 0.0)
        if expert_parallel > 1 and self.expert_params and self.moe_layers:
            experts = self.expert_params / self.moe_layers  # one layer's experts: the largest layer
            largest = max(largest - experts, 0.0) + experts / expert_parallel if largest >= experts else largest
        return largest


def _gpt2_params(layers: int, hidden: int, vocab: int = 50257, positions: int = 1024) -> tuple[int, int]:
    """(all, replicated under Megatron's plan: positions, 2 layer norms + 2 row-parallel biases per layer, ln_f)."""
    total = vocab * hidden + positions * hidden + layers * (12 * hidden**2 + 13 * hidden) + 2 * hidden
    return total, positions * hidden + layers * 6 * hidden + 2 * hidden


def _llama_params(layers: int, hidden: int, ffn: int, vocab: int = 32000) -> tuple[int, int]:
    """(all, replicated under HF's plan: 2 RMSNorm weights per layer and the final one)."""
    total = 2 * vocab * hidden + layers * (4 * hidden**2 + 3 * hidden * ffn + 2 * hidden) + hidden
    return total, (2 * layers + 1) * hidden


def _mixtral_params(layers: int, hidden: int, ffn: int, experts: int, kv_dim: int,
                    vocab: int = 32000) -> tuple[int, int]:
    """(all, the experts') of a Mixtral: GQA attention, E gated expert MLPs and a router per layer, untied head."""
    experts_per_layer = experts * 3 * hidden * ffn
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + experts_per_layer + experts * hidden + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden, layers * experts_per_layer


def _preset(name: str, counts: tuple[int, int], layers: int, hidden: int, heads: int, seq: int, vocab: int,
            largest_replicated: int, unit: int, small: int) -> ModelSpec:
    """``unit``: a block's matrices (its stage-3 unit); ``small``: its vectors (biases, norms: persistent)."""
    params, replicated = counts
    root = params - layers * (unit + small)
    return ModelSpec(float(params), name, layers, hidden, heads, seq, float(vocab * hidden), float(replicated),
                     float(largest_replicated), float(unit), float(root), float(layers * small))


# Parameter counts from the architectures' formulas (tied GPT-2 embeddings; untied Llama head); the largest
# layer is the (vocabulary-parallel) embedding, the largest replicated one GPT-2's position embedding.
PRESETS: dict[str, ModelSpec] = {
    p.name: p  # type: ignore[misc]
    for p in (
        _preset("gpt2", _gpt2_params(12, 768), 12, 768, 12, 1024, 50257, 1024 * 768, 12 * 768**2, 13 * 768),
        _preset("gpt2-medium", _gpt2_params(24, 1024), 24, 1024, 16, 1024, 50257, 1024 * 1024, 12 * 1024**2,
                13 * 1024),
        _preset("gpt2-large", _gpt2_params(36, 1280), 36, 1280, 20, 1024, 50257, 1024 * 1280, 12 * 1280**2,
                13 * 1280),
        _preset("gpt2-xl", _gpt2_params(48, 1600), 48, 1600, 25, 1024, 50257, 1024 * 1600, 12 * 1600**2, 13 * 1600),
        _preset("gpt3-175b", _gpt2_params(96, 12288, positions=2048), 96, 12288, 96, 2048, 50257, 2048 * 12288,
                12 * 12288**2, 13 * 12288),
        _preset("llama2-7b", _llama_params(32, 4096, 11008), 32, 4096, 32, 4096, 32000, 4096,
                4 * 4096**2 + 3 * 4096 * 11008, 2 * 4096),
        _preset("llama2-13b", _llama_params(40, 5120, 13824), 40, 5120, 40, 4096, 32000, 5120,
                4 * 5120**2 + 3 * 5120 * 13824, 2 * 5120),
    )
}
_MIXTRAL, _MIXTRAL_EXPERTS = _mixtral_params(32, 4096, 14336, 8, 1024)
# Mixtral 8x7B: 8 experts of 3 x 4096 x 14336 per layer, top-2 (46.7B parameters, 45.1B of them experts)
PRESETS["mixtral-8x7b"] = ModelSpec(float(_MIXTRAL), "mixtral-8x7b", 32, 4096, 32, 4096, float(8 * 3 * 4096 * 14336),
                                    expert_params=float(_MIXTRAL_EXPERTS), num_experts=8, top_k=2, moe_layers=32)


def _tp_counts(model: nn.Module) -> tuple[float, float] | None:
    """(replicated parameters, largest replicated module) under ``model``'s own tensor-parallel plan (a Hugging
    Face ``_tp_plan`` or ``tensor_parallel_plan()``), or ``None`` when it has none. A row-parallel layer's bias
    is replicated; everything else a planned module owns is split."""
    from lightning_zero.tensor_parallel.plan import find_plan, resolve_plan
    from lightning_zero.tensor_parallel.styles import Replicate, ReplicateGradSum, Rowwise

    try:
        plan, source = find_plan(model, None)
        resolved = resolve_plan(model, plan, source)
    except ValueError:
        return None
    split: set[int] = set()
    for name, style in resolved.entries:
        if isinstance(style, (Replicate, ReplicateGradSum)):
            continue
        for pname, p in model.get_submodule(name).named_parameters(recurse=False):
            if not (isinstance(style, Rowwise) and pname == "bias"):
                split.add(id(p))
    seen: set[int] = set()
    replicated = 0.0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen and id(p) not in split:
            seen.add(id(p))
            replicated += p.numel()
    largest = max((sum(p.numel() for p in m.parameters(recurse=False) if id(p) not in split) for m in model.modules()),
                  default=0)
    return replicated, float(largest)


def spec_of_module(model: nn.Module, name: str | None = None) -> ModelSpec:
    """Trainable parameters (shared ones once) and the largest single module of ``model``.

    Args:
        model: any module; meta-device parameters are fine.
        name: label for the result.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    tp = _tp_counts(model)
    unit, root, persistent, sizes = _unit_counts(model)
    return ModelSpec(float(total), name, largest_layer_params=float(largest),
                     replicated_params=None if tp is None else tp[0],
                     largest_replicated_layer_params=None if tp is None else tp[1],
                     unit_params=unit, root_params=root, persistent_params=persistent, unit_param_sizes=sizes,
                     **_moe_counts(model))


def _unit_counts(model: nn.Module, persistence_threshold: int = 100_000,
                 ) -> tuple[float | None, float, float, tuple[int, ...] | None]:
    """(largest stage-3 unit, root unit, persistent unit, the largest unit's parameter sizes) as stage 3 would
    plan them (the default units and persistence threshold); ``None`` for the unit when the model has no blocks."""
    from lightning_zero.core.stage3.units import PERSISTENT, ROOT, plan_units

    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    plans = plan_units(model, names, persistence_threshold=persistence_threshold)
    sizes = {plan.name: float(sum(p.numel() for p in plan.params)) for plan in plans}
    blocks = [p for p in plans if p.name not in (ROOT, PERSISTENT)]
    if not blocks:
        return None, sizes.get(ROOT, 0.0), sizes.get(PERSISTENT, 0.0), None
    big = max(blocks, key=lambda p: sum(q.numel() for q in p.params))
    return sizes[big.name], sizes.get(ROOT, 0.0), sizes.get(PERSISTENT, 0.0), tuple(p.numel() for p in big.params)


def _moe_counts(model: nn.Module) -> dict[str, Any]:
    """The expert parameters, experts per layer, experts per token and MoE layers of ``model`` (the layers expert
    parallelism splits: ``lightning_zero.parallel.expert.moe_layers``); empty for a dense model."""
    from lightning_zero.moe.experts import expert_parameter_names
    from lightning_zero.parallel.expert import moe_layers

    layers = [m for _, m in moe_layers(model)]
    if not layers:
        return {}
    params, experts, top_k = 0.0, 0, 0
    for layer in layers:
        e = int(layer.num_experts)
        holder = getattr(layer, "experts", layer)  # MoELayer holds its experts; a Hugging Face experts module is one
        params += sum(getattr(holder, n).numel() for n in expert_parameter_names(holder, e))
        gate = getattr(layer, "gate", None)
        config = getattr(layer, "config", None)
        k = gate.policy.k if gate is not None else getattr(config, "num_experts_per_tok", 0)
        experts, top_k = max(experts, e), max(top_k, int(k or 0))
    return {"expert_params": params, "num_experts": experts, "top_k": top_k or None, "moe_layers": len(layers)}


def _project_preset(name: str) -> ModelSpec | None:
    """A preset of ``lightning_zero.models.gpt.GPT_PRESETS`` (this repository's GPT), built on meta and counted."""
    if name not in GPT_PRESETS:
        return None
    from lightning_zero.models.gpt import GPTLightningModule

    cfg = GPT_PRESETS[name]
    with torch.device("meta"):  # the LightningModule: it carries the GPT's tensor-parallel plan
        counted = spec_of_module(GPTLightningModule(cfg), name)
    return replace(counted, layers=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, seq_len=cfg.seq_len)


def resolve_model(model: str | nn.Module) -> ModelSpec:
    """A :class:`ModelSpec` from a preset name, a module instance or ``"module.path:attr"``.

    Presets are :data:`PRESETS` and this repository's GPT presets
    (``lightning_zero.models.gpt.GPT_PRESETS``, e.g. ``gpt_small``).

    ``attr`` names a class or factory called with no arguments under ``torch.device("meta")`` (no
    memory is allocated); a LightningModule's ``configure_model`` hook is called there too.

    Args:
        model: preset (see :data:`PRESETS`), ``nn.Module``, or import path ``"pkg.mod:Class"``.
    """
    if isinstance(model, nn.Module):
        return spec_of_module(model, type(model).__name__)
    if model in PRESETS:
        return PRESETS[model]
    project = _project_preset(model)
    if project is not None:
        return project
    module_name, sep, attr = model.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"Unknown model {model!r}. Give a preset ({', '.join(PRESETS)}) or an import path "
            "'package.module:ClassOrFactory' whose call with no arguments builds the nn.Module."
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"Cannot load {model!r}: {err}. Check the module is importable (PYTHONPATH).") from err
    with torch.device("meta"):
        built = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
        hook = getattr(built, "configure_model", None)
        if callable(hook):
            hook()
    if not isinstance(built, nn.Module):
        raise ValueError(f"{model!r} built a {type(built).__name__}, not a torch.nn.Module.")
    return spec_of_module(built, model)
