"""The Hydra schemas of the settings tree's groups (``zero/``, ``offload/``, ``precision/``, ``pipeline/``,
``tensor_parallel/``, ``expert_parallel/``, ``sequence_parallel/``): each a mirror of its node in
``core/settings/`` where the node declares the knobs, so that a knob and its default are written once, next to
the mechanism (:func:`mirror`, :func:`in_yaml`), and option lists kept in the core become enums the same way
(:func:`choices_of`). ``config/settings.py`` translates them into the tree; ``schema.py``'s :class:`TrainConfig`
holds them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from enum import Enum
from typing import Any, get_type_hints

from lightning_zero.core.common.choices import Collective as CoreCollective
from lightning_zero.core.common.choices import PipeSchedule as CorePipeSchedule
from lightning_zero.core.settings import offload as core_offload
from lightning_zero.core.settings import zero as core_zero
from lightning_zero.core.settings.precision import LossScalerConfig


def choices_of(name: str, values: Iterable[str], doc: str) -> Any:
    """An ``Enum`` of the options ``values`` (each member named as its value), for options whose list
    lives elsewhere."""
    choices = Enum(name, [(v, v) for v in values])  # type: ignore[misc]
    choices.__module__, choices.__doc__ = __name__, doc
    return choices


def fields_of(source: type) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of a dataclass's fields, or of the parameters of a class's ``__init__``."""
    if is_dataclass(source):
        hints = get_type_hints(source)
        return [(f.name, hints[f.name], f.default) for f in fields(source)]
    hints = get_type_hints(source.__init__)
    return [(p.name, hints[p.name], p.default) for p in inspect.signature(source).parameters.values()]


def mirror(name: str, doc: str, *parts: tuple[str, Any, Any] | type, base: type | None = None,
           module: str = __name__) -> Any:
    """A schema dataclass (subclassing ``base``) whose fields are ``parts`` in order: a ``(name, type,
    default)`` field, or a frozen core dataclass or a class whose fields / ``__init__`` parameters are
    taken over with their types and defaults, so that a knob and its default are written once, next
    to the mechanism (``module``: the module that defines it). (The schema itself is mutable: Hydra merges
    overrides into it.)"""
    specs = [(n, t, field(default_factory=lambda d=d: list(d)) if isinstance(d, list) else field(default=d))
             for part in parts for n, t, d in ([part] if isinstance(part, tuple) else fields_of(part))]
    schema = make_dataclass(name, specs, bases=(base,) if base else (), namespace={"__doc__": doc})
    schema.__module__ = module
    return schema


Collective = choices_of("Collective", [c.value for c in CoreCollective],
                      "Gradient / parameter collectives of the ZeRO engine (``ZeroConfig.collective``).")


def in_yaml(source: type, types: dict[str, Any], leave_out: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of a core dataclass's fields in the types YAML writes them in (``types``: a
    field's YAML type; its default converted to it: an enum's value, a tuple of classes as a list of import
    paths), so that the default stays written once, in the core."""
    out = []
    for name, hint, default in fields_of(source):
        if name in leave_out:
            continue
        yaml_type = types.get(name, hint)
        value = default.value if isinstance(default, Enum) else default
        if isinstance(yaml_type, type) and issubclass(yaml_type, Enum):
            value = yaml_type(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif yaml_type in (int, str):
            value = yaml_type(value)
        out.append((name, yaml_type, value))
    return out


# precision mode -> Lightning's string
LIGHTNING_PRECISION: dict[str, str] = {"fp32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed",
                                       "bf16_true": "bf16-true"}
PrecisionName = choices_of("PrecisionName", LIGHTNING_PRECISION,
                         "Precision modes: the keys of :data:`LIGHTNING_PRECISION`.")


PipeSchedule = choices_of("PipeSchedule", ["none", *(s.name.lower() for s in CorePipeSchedule)],
                        "Pipeline schedules: ``none`` (no pipeline) and the core's ``PipeSchedule`` by name "
                        "(``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``).")


ZeroSchema = mirror(
    "ZeroSchema",
    """``zero/``: the ZeRO stage and its knobs, the fields of :class:`~lightning_zero.ZeroConfig` (each default written
    once, there) in YAML's types: the stage an int, ``collective`` the :class:`Collective` options, ``nonfinite`` a
    string (``raise`` cannot be an enum member name, which OmegaConf parses by; ``ZeroConfig`` checks it),
    ``elementwise_optimizers`` / ``unit_classes`` as ``"module.path:ClassName"`` import paths; and the strategy's
    ``check_step_errors`` and ``gather_on_teardown`` (the CLI needs nothing back after fit, as validate_at_end runs
    inside it, so by default it does not gather; docs/zero.md). ``activation_checkpointing`` is the model's choice,
    not a ``zero/`` option.""",
    *in_yaml(core_zero.ZeroConfig, {"stage": int, "collective": Collective, "nonfinite": str,
                                     "elementwise_optimizers": list[str], "unit_classes": list[str]},
              leave_out=("activation_checkpointing",)),
    ("check_step_errors", bool, True),
    ("gather_on_teardown", bool, False),
)


OffloadSchema = mirror(
    "OffloadSchema",
    """``offload/``: ZeRO-Offload / ZeRO-Infinity (DeepSpeed's ``offload_optimizer`` / ``offload_param``), the fields
    of :class:`~lightning_zero.OffloadConfig` (each default written once, there); ``pin_memory`` may be ``null``:
    pinned where ``trainer.accelerator`` is not cpu and CUDA is there (the cpu presets), so CPU runs do not warn
    on every rank (DeepSpeed's default is false; true needs an accelerator, else a warning).""",
    *in_yaml(core_offload.OffloadConfig, {"pin_memory": bool | None}),
)


PrecisionSchema = mirror(
    "PrecisionSchema",
    """``precision/``: the mode, DeepSpeed's fp16 loss-scaler knobs (the fields of
    :class:`~lightning_zero.core.precision.loss_scaler.LossScalerConfig`; ``loss_scale=0`` means dynamic) and the
    gradient dtypes (``reduce_dtype``: DeepSpeed's ``communication_data_type``; ``grad_accum_dtype``:
    ``data_types.grad_accum_dtype``; ``null`` = the compute dtype).""",
    ("name", PrecisionName, PrecisionName.fp32),
    LossScalerConfig,
    ("reduce_dtype", str | None, None),  # float32, float16 or bfloat16
    ("grad_accum_dtype", str | None, None),
)


@dataclass
class PipelineSchema:
    """``pipeline/``: pipeline-parallel stages, schedule and micro-batches (``stages=1``: no pipeline)."""

    stages: int = 1
    schedule: PipeSchedule = PipeSchedule.none
    micro_batches: int = 1
    virtual_stages: int = 1
    partition_method: str = "parameters"
    activation_checkpoint_interval: int = 0
    reduce_per_micro_batch: bool = False  # ZeRO 2-3, no ties across stages (docs/pipeline.md)


@dataclass
class TensorParallelSchema:
    """``tensor_parallel/``: ranks per tensor-parallel group (``size=1``: none; docs/tensor_parallel.md). The
    model's own plan is used (the GPT's ``tensor_parallel_plan``)."""

    size: int = 1


@dataclass
class ExpertParallelSchema:
    """``expert_parallel/``: ranks per expert-parallel group (each MoE layer's experts split over data ranks,
    docs/expert_parallel.md; 1: off). The model needs MoE layers (``model.moe.num_experts``)."""

    size: int = 1


@dataclass
class SequenceParallelSchema:
    """``sequence_parallel/``: ranks per sequence group (DeepSpeed-Ulysses, docs/sequence_parallel.md; 1: off)."""

    size: int = 1
