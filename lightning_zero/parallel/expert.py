"""Expert parallelism applied to a module (:func:`apply_expert_parallel`): the size chosen (:func:`expert_settings`),
the MoE layers found and split over the mesh's expert-parallel group, the expert parameters handed to ZeRO. The
combinations not built are refused before launch by the settings tree's rules (``core/settings/rules.py``).

Note [expert parallel in the strategy]
    ``ZeroStrategy(expert_parallel=N)`` (or an :class:`~lightning_zero.moe.ExpertParallelConfig`, the settings
    tree's ``parallel.expert``) sets the size; without it, DeepSpeed-style :class:`~lightning_zero.moe.MoE` layers
    built with ``ep_size > 1`` set it (all alike), else there is none: :func:`expert_settings` resolves it against
    the module at setup into the tree the mesh and every step then read (its rules checked again). The mesh carves
    the expert axis out of the data ranks (Note [expert axes] in core/mesh/dims.py). In
    :func:`~lightning_zero.parallel.parallelize.parallelize`, after tensor and sequence parallel and before ZeRO
    (which records the parameters it flattens), every MoE layer of the module is split: the project's
    :class:`MoELayer` (the GPT's MoE option and ``MoE``) and the Hugging Face experts a ``base_model_ep_plan`` names
    (Note [Hugging Face experts] in moe/hf.py). Each keeps this rank's experts (Note [expert split] in
    moe/experts.py); the precision plugin's pre-cast weights are cut alike, so the fp32 masters start from the exact
    slices. ZeRO then reduces and partitions the expert parameters over the expert-data group and the rest over the
    data group (Note [partitioned reduction] in core/zero/partitioned_reducer.py). The module stays split after the
    fit (as tensor parallel leaves it); the strategy's state dicts and checkpoints hold the unsplit experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from lightning_zero.core.mesh.dims import Axis
from lightning_zero.core.mesh.groups import ProcessMesh
from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.rules import CANONICAL, check_settings
from lightning_zero.core.settings.tree import Settings
from lightning_zero.moe.dispatch import ExpertGroup
from lightning_zero.moe.experts import ExpertSplit, expert_split_of
from lightning_zero.moe.hf import attach_hf_experts, hf_expert_modules
from lightning_zero.moe.layer import MoE, MoELayer


def moe_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every layer expert parallelism splits: the project's :class:`MoELayer` s and the Hugging Face experts a
    ``base_model_ep_plan`` names, in module order."""
    ours = [(n, m) for n, m in module.named_modules() if isinstance(m, MoELayer)]
    return sorted(ours + hf_expert_modules(module), key=lambda nm: list(dict(module.named_modules())).index(nm[0]))


def expert_size(config: ExpertParallelConfig | None, module: nn.Module | None) -> int:
    """The expert-parallel size (Note [expert parallel in the strategy]): the strategy's, else the ``ep_size`` of
    the module's ``MoE`` layers, else 1.

    Raises:
        ValueError: ``MoE`` layers built with different ``ep_size`` s, or one that differs from the strategy's.
    """
    declared = sorted({m.ep_size for m in module.modules() if isinstance(m, MoE) and m.ep_size > 1}) if module else []
    if config is not None:
        other = [s for s in declared if s != config.size]
        if other:
            raise ValueError(f"MoE layers were built with ep_size={other[0]} but ZeroStrategy(expert_parallel="
                             f"{config.size}): build them with ep_size=1 (the strategy decides) or the same size")
        return config.size
    if len(declared) > 1:
        raise ValueError(f"MoE layers were built with different ep_size {declared}: use one size, or set "
                         "ZeroStrategy(expert_parallel=N)")
    return declared[0] if declared else 1


def expert_settings(settings: Settings, module: nn.Module | None,
                    spelling: Mapping[str, str] = CANONICAL) -> Settings:
    """``settings`` with the expert-parallel size this setup runs with (:func:`expert_size`: the strategy's, else
    the ``MoE`` layers' ``ep_size``); the tree's rules checked again when the layers set it (named as ``spelling``).
    """
    size = expert_size(settings.parallel.expert, module)
    if size == settings.parallel.experts:
        return settings
    return check_settings(replace(settings, parallel=replace(settings.parallel, expert=ExpertParallelConfig(size))),
                          spelling)


class StrategyExpertParallel:
    """One strategy's expert-parallel state: the group (from the mesh), the layers split, the expert parameters.

    Args:
        mesh: the strategy's mesh (its expert axis on).
    """

    def __init__(self, mesh: ProcessMesh) -> None:
        self.mesh = mesh
        self.ep = ExpertGroup(mesh.group(Axis.EXPERT), mesh.dims.expert, mesh.index(Axis.EXPERT))
        self.layers: list[str] = []
        self.experts: frozenset[nn.Parameter] = frozenset()
        self.sliced: dict[nn.Parameter, nn.Parameter] = {}  # each whole parameter split -> this rank's slice
        self._module: nn.Module | None = None

    def apply(self, module: nn.Module) -> None:
        """Split every MoE layer of ``module`` (Note [expert parallel in the strategy]); the module this strategy
        split already (``validate`` then ``fit``) stays as it is."""
        if self.layers and module is self._module:
            self.experts = frozenset(p for p in module.parameters() if expert_split_of(p) is not None)
            return
        if any(p.is_meta for p in module.parameters()):
            raise ValueError("expert_parallel with a model built on the meta device (configure_model at ZeRO stage 3) "
                             "is not built yet: build the model whole (every rank keeps its experts of it), or drop "
                             "expert_parallel")
        layers = moe_layers(module)
        if not layers:
            raise ValueError(f"expert_parallel={self.ep.size}: {type(module).__name__} has no MoE layer to split (a "
                             "lightning_zero.moe.MoE / MoELayer, the GPT's model.moe option, or a Hugging Face MoE "
                             "with a base_model_ep_plan): drop expert_parallel, or add MoE layers")
        memo: dict[nn.Parameter, nn.Parameter] = {}
        parts: list[nn.Parameter] = []
        for _, layer in layers:
            parts += (layer.attach_expert_group(self.ep, memo) if isinstance(layer, MoELayer)
                      else attach_hf_experts(layer, self.ep, memo))
        self.layers = [n for n, _ in layers]
        self.experts = frozenset(parts)
        self.sliced = memo
        self._module = module

    def splits(self, module: nn.Module) -> bool:
        """Whether ``module`` is the one this strategy split (its expert states are this rank's slices)."""
        return bool(self.layers) and module is self._module

    def slice_originals(self, originals: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """The precision plugin's pre-cast weights after :meth:`apply`: each expert parameter's cut like it, keyed
        by its slice; then the whole parameters are forgotten."""
        out: dict[nn.Parameter, torch.Tensor] = {}
        for param, whole in originals.items():
            part = self.sliced.get(param)
            if part is None:
                out[param] = whole
            else:
                split = expert_split_of(part)
                assert isinstance(split, ExpertSplit)
                out[part] = split.local(whole)
        self.sliced = {}
        return out


def apply_expert_parallel(module: nn.Module, mesh: ProcessMesh,
                          previous: StrategyExpertParallel | None = None) -> StrategyExpertParallel | None:
    """Expert parallelism applied to ``module`` on ``mesh`` (``None``: its expert axis is off): every MoE layer keeps
    this rank's experts. ``previous``, the last setup's on the same mesh, is kept: it knows the module it split
    already (``validate`` then ``fit`` of one module)."""
    if not mesh.dims.expert_enabled:
        return None
    expert = previous if previous is not None and previous.mesh is mesh else StrategyExpertParallel(mesh)
    expert.apply(module)
    return expert
