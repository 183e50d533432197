"""Which modules to split and how: finding the plan (a Hugging Face model's own, the LightningModule's, or
the ``"auto"`` rule), checking it against the model, and applying it by slicing the built weights.

Note [plan order]
    ``TensorParallelConfig.plan``:

    * a dict ``{pattern: style}`` is the plan (patterns are dotted module names from the LightningModule,
      ``*`` standing for one name, as in HF's ``"layers.*.self_attn.q_proj"`` and torch's
      ``parallelize_module``; styles are HF strings, torch objects or ours: ``styles.py``);
    * ``"auto"``: AutoTP's rule for plain ``nn.Linear`` stacks: inside an ``nn.Sequential``, two
      ``nn.Linear`` separated only by element-wise modules become column- then row-parallel;
    * ``None`` (default): the LightningModule's ``tensor_parallel_plan()`` (method or dict attribute) when it
      defines one: written for this model, it wins over a Hugging Face submodule's plan (logged, naming
      both); else a Hugging Face model's own ``_tp_plan`` / ``config.base_model_tp_plan``, found among the
      LightningModule's submodules and prefixed with its name; else it is refused, naming both fixes.

Note [slice after build]
    A plan is applied to the whole, initialised model: each rank builds every weight with the same seed
    and keeps its slice. So a run's weights do not depend on the tensor-parallel size. The price is one
    whole copy of the model per rank for the moment between construction and slicing (the whole copy is
    freed when the plan is applied, before ZeRO flattens). Under a pipeline the plan is applied after the
    split, so a rank builds whole only its own stage's layers (a model built in ``configure_model`` on the
    meta device materialises only those; Note [local construction] in pipeline/build.py). Unpipelined, a
    model built on the meta device is refused with TP for now (slicing at construction is a later slice).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_zero.core.common.errors import UsageError
from lightning_zero.tensor_parallel.collectives import TPGroup
from lightning_zero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SliceMemo,
    VocabParallelEmbedding,
)
from lightning_zero.tensor_parallel.regions import hook_replicated_grads
from lightning_zero.tensor_parallel.rng import SplitRegionDropout, SplitRegionRNG, split_hf_attention
from lightning_zero.tensor_parallel.styles import (
    Colwise,
    Replicate,
    ReplicateGradSum,
    Rowwise,
    Style,
    VocabEmbedding,
    resolve_style,
)

log = logging.getLogger(__name__)

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Dropout, nn.Identity, nn.Mish)


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan as concrete module names (in module order) with their styles, and where it came from."""

    entries: tuple[tuple[str, Style], ...]
    source: str


def hf_plan(root: nn.Module) -> dict[str, Any] | None:
    """The tensor-parallel plan Hugging Face models among ``root``'s submodules carry, keys prefixed with the
    submodule's name (outer models first; a key an outer model names wins), or ``None`` when there is none."""
    plan: dict[str, Any] = {}
    for prefix, module in root.named_modules():
        if not hasattr(module, "base_model_prefix"):  # an HF model (PreTrainedModel), not a layer sharing its config
            continue
        own = dict(getattr(module, "_tp_plan", None) or {})
        config = getattr(module, "config", None)
        base = getattr(config, "base_model_tp_plan", None) if config is not None else None
        base_prefix = getattr(module, "base_model_prefix", "")
        if base and base_prefix and hasattr(module, base_prefix):
            own.update({f"{base_prefix}.{k}": v for k, v in base.items() if f"{base_prefix}.{k}" not in own})
        elif base:  # the base model itself
            own.update({k: v for k, v in base.items() if k not in own})
        for key, style in own.items():
            plan.setdefault(f"{prefix}.{key}" if prefix else key, style)
    return plan or None


def auto_plan(root: nn.Module) -> dict[str, Style]:
    """AutoTP's rule (Note [plan order]): column- then row-parallel pairs of ``nn.Linear`` in ``nn.Sequential``s."""
    plan: dict[str, Style] = {}
    for prefix, module in root.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        pending: str | None = None
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if type(child) is nn.Linear:
                if pending is None:
                    pending = full
                else:
                    plan[pending], plan[full] = Colwise(), Rowwise()
                    pending = None
            elif not isinstance(child, ELEMENTWISE):
                pending = None
    if not plan:
        raise ValueError("tensor_parallel plan='auto' found no pair of nn.Linear layers separated only by element-wise "
                         "modules inside an nn.Sequential: give a plan dict ({'name.*.fc1': 'colwise', ...})")
    return plan


def find_plan(root: nn.Module, plan: Mapping[str, Any] | str | None) -> tuple[Mapping[str, Any], str]:
    """The plan to apply and where it came from (Note [plan order])."""
    if isinstance(plan, Mapping):
        return plan, "the given plan"
    if plan == "auto":
        return auto_plan(root), "plan='auto'"
    if plan is not None:
        raise ValueError(f"tensor_parallel plan must be a dict, 'auto' or None, got {plan!r}")
    found = hf_plan(root)
    method = getattr(root, "tensor_parallel_plan", None)
    if method is not None:
        own = method() if callable(method) else method
        if not found:
            return own, "the LightningModule's tensor_parallel_plan"
        hf = next(n for n, m in root.named_modules() if hasattr(m, "base_model_prefix"))
        log.info(f"tensor_parallel: {type(root).__name__}.tensor_parallel_plan() is used instead of the _tp_plan of "
                 f"the Hugging Face model {hf!r} (the LightningModule's own plan wins; return that model's plan "
                 "from it, or delete the method, to use the Hugging Face one)")
        return own, "the LightningModule's tensor_parallel_plan (over the Hugging Face model's _tp_plan)"
    if found:
        return found, "the Hugging Face model's _tp_plan"
    raise UsageError(f"{type(root).__name__} carries no tensor-parallel plan: define `tensor_parallel_plan()` on it "
                     "(a dict of module-name patterns to styles), pass TensorParallelConfig(plan={...}), or "
                     "plan='auto' for plain nn.Linear stacks")


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + "$")


def resolve_plan(root: nn.Module, plan: Mapping[str, Any], source: str) -> ResolvedPlan:
    """Every plan key matched against ``root``'s module names and every style checked, before anything changes.

    Raises:
        ValueError: a key matching no module, an unknown or unbuilt style, a style on a module of the wrong
            kind, or two keys claiming one module with different styles.
    """
    styles = {key: resolve_style(style, key) for key, style in plan.items()}
    modules = dict(root.named_modules())
    chosen: dict[str, Style] = {}
    for key, style in styles.items():
        regex = _pattern(key)
        hits = [name for name in modules if name and regex.match(name)]
        if not hits:
            near = [n for n in modules if n and n.split(".")[-1] == key.split(".")[-1]][:3]
            raise ValueError(f"tensor_parallel plan ({source}) names {key!r}, which matches no module of "
                             f"{type(root).__name__}" + (f" (modules with that last name: {near})" if near else "")
                             + ": fix the pattern (dotted names from the LightningModule, '*' for one name)")
        for name in hits:
            if chosen.get(name, style) != style:
                raise ValueError(f"tensor_parallel plan ({source}): {name!r} is matched as {chosen[name]} and {style} "
                                 "by two entries. Fix: give it one style (narrow one pattern so that it no longer "
                                 "matches, or give both entries the same style)")
            chosen[name] = style
    for name, style in chosen.items():
        module = modules[name]
        if isinstance(module, nn.Embedding) and isinstance(style, (Rowwise, Colwise)):
            chosen[name] = style = _embedding_style(name, style)
        need = nn.Embedding if isinstance(style, VocabEmbedding) else nn.Linear
        if not isinstance(style, (Replicate, ReplicateGradSum)) and not isinstance(module, need):
            raise ValueError(f"tensor_parallel plan ({source}): {name!r} is a {type(module).__name__}, but style "
                             f"{style} splits an {need.__name__}: leave it out of the plan")
    order = [n for n in modules if n in chosen]
    entries = tuple((n, chosen[n]) for n in order)
    if not any(not isinstance(s, (Replicate, ReplicateGradSum)) for _, s in entries):
        raise ValueError(f"tensor_parallel plan ({source}) splits no module: every rank would hold the whole model. "
                         "Fix: split at least one nn.Linear ('colwise' / 'rowwise') or nn.Embedding "
                         "('embedding_rowwise'), or drop tensor_parallel")
    return ResolvedPlan(entries, source)


def _embedding_style(name: str, style: Rowwise | Colwise) -> VocabEmbedding:
    """torch's styles on an ``nn.Embedding``: ``RowwiseParallel`` splits its rows, the vocabulary (torchtitan's
    ``tok_embeddings``): our :class:`VocabEmbedding`; ``ColwiseParallel`` would split the embedding dimension."""
    if isinstance(style, Colwise):
        raise ValueError(f"tensor_parallel plan: {name!r} is an nn.Embedding: ColwiseParallel would split its "
                         "embedding dimension, which is not built. Fix: RowwiseParallel(input_layouts=Replicate()) or "
                         "'embedding_rowwise' (a vocabulary-parallel embedding), or leave it out of the plan")
    return VocabEmbedding()


def check_heads(root: nn.Module, size: int) -> None:
    """Refuse a Hugging Face model whose attention heads or KV heads do not split over ``size`` ranks."""
    for name, module in root.named_modules():
        config = getattr(module, "config", None)
        heads = getattr(config, "num_attention_heads", getattr(config, "n_head", None))
        if not isinstance(heads, int):
            continue
        kv = getattr(config, "num_key_value_heads", None) or heads
        for what, count in (("attention heads", heads), ("KV heads", kv)):
            if count % size:
                raise ValueError(f"{name or type(root).__name__}: {count} {what} do not split over tensor_parallel="
                                 f"{size}: choose a tensor-parallel size dividing {count}")
        return


def apply_plan(root: nn.Module, resolved: ResolvedPlan, tp: TPGroup, memo: SliceMemo | None = None) -> list[str]:
    """Replace each planned module with its parallel version holding this rank's slices (Note [slice after
    build]); returns the names split. Parameters shared between modules stay shared (``slice_param``);
    ``memo`` (filled) records each whole parameter and its slice."""
    memo = {} if memo is None else memo
    split = []
    summed: list[tuple[str, nn.Module]] = []  # the modules whose gradients are summed over the group
    rng = SplitRegionRNG(tp.rank)  # Note [dropout streams]
    for name, style in resolved.entries:
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        module = getattr(parent, attr)
        new: nn.Module
        if isinstance(style, Replicate):
            continue
        if isinstance(style, ReplicateGradSum):
            summed.append((name, module))
            continue
        if isinstance(style, Colwise):
            new = ColumnParallelLinear(module, tp, memo, name, style.chunks, style.gather_output)
            new.tp_rng = rng
        elif isinstance(style, Rowwise):
            new = RowParallelLinear(module, tp, memo, name, style.input_is_parallel)
        else:
            new = VocabParallelEmbedding(module, tp, memo, name)
        setattr(parent, attr, new)
        split.append(name)
    _retie(root, memo)
    _split_region_dropouts(root, rng)
    if any(hasattr(getattr(m, "config", None), "_attn_implementation") for m in root.modules()):
        split_hf_attention(root, rng)  # a Hugging Face model's attention dropout (Note [dropout streams])
    hook_replicated_grads(root, tp, summed)  # Note [replicated parameters on split activations]
    return split


def _split_region_dropouts(root: nn.Module, rng: SplitRegionRNG) -> None:
    """Each ``nn.Dropout`` of an ``nn.Sequential`` between a column-parallel layer's split output and the next
    row-parallel layer, across element-wise modules only, draws this TP rank's masks (Note [dropout streams])."""
    for seq in [m for m in root.modules() if isinstance(m, nn.Sequential)]:
        inside = False
        for name, child in list(seq.named_children()):
            if isinstance(child, ColumnParallelLinear):
                inside = not child.gather_output
            elif inside and type(child) is nn.Dropout:
                setattr(seq, name, SplitRegionDropout(child, rng))
            elif not isinstance(child, ELEMENTWISE):
                inside = False


def _retie(root: nn.Module, memo: SliceMemo) -> None:
    """A whole parameter that a split module replaced but another, unplanned module still uses would leave
    the two untied: refuse, naming both."""
    for name, param in root.named_parameters(remove_duplicate=False):
        if id(param) in memo and memo[id(param)][0] is param:
            raise ValueError(f"{name} is tied to a parameter the plan splits, but its module is not in the plan: "
                             "add it with the same split (e.g. the tied LM head 'colwise' with a vocabulary-parallel "
                             "embedding), or untie the weights")
