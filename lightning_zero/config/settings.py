"""A Hydra config as the settings tree (:func:`settings_of`: the Hydra route in, Note [one settings tree] in
``core/settings/tree.py``), and every reason it cannot be built (:func:`hydra_settings_problems`), which
``validate.py`` runs before any rank starts; the checks of those settings that need the model, the data or the
world are ``parallel_checks.py``'s.

Each ``*_settings`` function translates one group into its node and adds no rule: a node checks its own values,
``core/settings/rules.py`` the rules across nodes, named here as the Hydra keys (:data:`HYDRA_KEYS`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from lightning_zero.config.schema import TrainConfig
from lightning_zero.config.settings_schema import LIGHTNING_PRECISION, PipeSchedule, PrecisionSchema
from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.offload import OffloadConfig
from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.core.settings.precision import LossScalerConfig, PrecisionConfig
from lightning_zero.core.settings.rules import CANONICAL, settings_problems
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.tree import ParallelSettings, Settings
from lightning_zero.core.settings.zero import ZeroConfig

HYDRA_KEYS = CANONICAL  # the tree's keys are the Hydra groups' (Note [one rule, many spellings])
_SCALER_KNOBS = tuple(f.name for f in fields(LossScalerConfig))


def import_object(path: str) -> Any:
    """The object at ``"package.module:Name"`` (or ``"package.module.Name"``)."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ValueError(f"expected 'module.path:Name', got {path!r}")
    return getattr(importlib.import_module(module), name)


def zero_settings(cfg: TrainConfig, imports: bool = True) -> ZeroConfig:
    """The ZeRO node of ``cfg.zero`` (its ``elementwise_optimizers`` / ``unit_classes`` imported, unless
    ``imports=False``: the launcher's checks and a JSON's comparison leave them out)."""
    z = cfg.zero
    classes = {key: tuple(import_object(p) for p in getattr(z, key)) if imports else ()
               for key in ("elementwise_optimizers", "unit_classes")}
    return ZeroConfig(stage=z.stage, reduce_bucket_size=int(z.reduce_bucket_size), overlap_comm=z.overlap_comm,
                      collective=z.collective.value, timeout_s=z.timeout_s,
                      hang_timeout_s=z.hang_timeout_s, nonfinite=z.nonfinite,
                      prefetch_bucket_size=int(z.prefetch_bucket_size), max_live_parameters=int(z.max_live_parameters),
                      max_reuse_distance=int(z.max_reuse_distance),
                      param_persistence_threshold=int(z.param_persistence_threshold), **classes)


def offload_settings(cfg: TrainConfig) -> OffloadConfig:
    """The offload node of ``cfg.offload`` (``pin_memory: null`` resolved: pinned where the run has CUDA)."""
    o = cfg.offload
    pin = bool(o.pin_memory) if o.pin_memory is not None else \
        str(cfg.trainer.accelerator) not in ("cpu",) and torch.cuda.is_available()
    return OffloadConfig(optimizer_device=o.optimizer_device.value, param_device=o.param_device.value,
                         nvme_path=o.nvme_path, pin_memory=pin,
                         buffer_count=None if o.buffer_count is None else int(o.buffer_count),
                         pipeline_read=bool(o.pipeline_read), pipeline_write=bool(o.pipeline_write),
                         max_in_cpu=int(o.max_in_cpu), sub_group_size=int(o.sub_group_size))


def pipeline_settings(cfg: TrainConfig) -> PipelineConfig | None:
    """The pipeline node of ``cfg.pipeline`` (``None`` for ``pipeline=none``)."""
    pp = cfg.pipeline
    if pp.stages <= 1 or pp.schedule is PipeSchedule.none:  # a schedule without stages: pipeline_problems
        return None
    return PipelineConfig(stages=pp.stages, micro_batches=pp.micro_batches, schedule=pp.schedule.value,
                          virtual_stages=pp.virtual_stages, partition_method=pp.partition_method,
                          activation_checkpoint_interval=pp.activation_checkpoint_interval,
                          reduce_per_micro_batch=pp.reduce_per_micro_batch)


def _scaler_knobs_set(cfg: TrainConfig) -> list[str]:
    p, defaults = cfg.precision, PrecisionSchema()
    return [k for k in _SCALER_KNOBS if getattr(p, k) != getattr(defaults, k)]


def precision_settings(cfg: TrainConfig) -> PrecisionConfig:
    """The precision node of ``cfg.precision``: a loss scaler when fp16, or when any of its knobs is set."""
    p = cfg.precision
    scaled = p.name.value == "fp16" or bool(_scaler_knobs_set(cfg))
    return PrecisionConfig(LIGHTNING_PRECISION[p.name.value],
                           LossScalerConfig(**{k: getattr(p, k) for k in _SCALER_KNOBS}) if scaled else None,
                           p.reduce_dtype, p.grad_accum_dtype)


def _unscaled_precision(cfg: TrainConfig) -> tuple[str, PrecisionConfig]:
    """Loss-scaler knobs set with bf16 / fp32, in the Hydra keys, and the node without them (so that the rules
    across nodes are still checked: every problem at once)."""
    knobs, p = _scaler_knobs_set(cfg), cfg.precision
    why = (f"{', '.join(f'precision.{k}' for k in knobs)} set with precision={p.name.value}: loss scaling applies "
           "to fp16 only. Fix: precision=fp16, or drop those overrides.")
    return why, PrecisionConfig(LIGHTNING_PRECISION[p.name.value], None, p.reduce_dtype, p.grad_accum_dtype)


_NODES: dict[str, Callable[[TrainConfig], Any]] = {
    "zero": zero_settings, "offload": offload_settings, "pipeline": pipeline_settings,
    "precision": precision_settings,
    "tensor_parallel": lambda cfg: TensorParallelConfig(cfg.tensor_parallel.size),
    "expert_parallel": lambda cfg: ExpertParallelConfig(cfg.expert_parallel.size) if cfg.expert_parallel.size != 1
    else None,
}


def settings_of(cfg: TrainConfig) -> Settings:
    """The settings tree of a validated config (what ``lightning-zero train``'s ranks run with)."""
    nodes = {group: node(cfg) for group, node in _NODES.items()}
    return Settings(zero=nodes["zero"], offload=nodes["offload"], precision=nodes["precision"],
                    parallel=ParallelSettings(nodes["pipeline"], nodes["tensor_parallel"], cfg.sequence_parallel.size,
                                              nodes["expert_parallel"]))


def hydra_settings_problems(cfg: TrainConfig) -> list[str]:
    """Every reason the settings tree of ``cfg`` cannot be built, named as the Hydra keys: each node's own
    error (``group: why``), then every rule across nodes that is broken."""
    nodes, out = {}, []
    for group, node in _NODES.items():
        try:
            if group == "precision" and cfg.precision.name.value != "fp16" and _scaler_knobs_set(cfg):
                why, nodes[group] = _unscaled_precision(cfg)
                out.append(why)
                continue
            nodes[group] = node(cfg)
        except (ValueError, TypeError) as err:
            out.append(f"{group}: {err}")
        except (ImportError, AttributeError) as err:  # elementwise_optimizers / unit_classes
            out.append(f"zero: cannot import a class of zero.elementwise_optimizers / zero.unit_classes ({err}).")
    if len(nodes) < len(_NODES):  # a node that could not be built: the rules across nodes need every node
        return out
    try:
        parallel = ParallelSettings(nodes["pipeline"], nodes["tensor_parallel"], cfg.sequence_parallel.size,
                                    nodes["expert_parallel"])
    except ValueError as err:
        return [*out, f"sequence_parallel: {err}"]
    tree = Settings(zero=nodes["zero"], offload=nodes["offload"], parallel=parallel, precision=nodes["precision"])
    return settings_problems(tree, HYDRA_KEYS) + out


