"""Read a DeepSpeed JSON config (a file or a dict) into one frozen :class:`DeepSpeedConfig`.

Each key is mapped onto lightning_zero's settings; accepted, its value being what lightning_zero does
anyway (``contiguous_gradients: true``); refused, asking for a feature that would change what is
computed or stored (``deepspeed/refused.py``); or, a performance hint or monitor, named in one warning
(an error with ``strict=True``). ``"auto"`` counts as not set. Keys the JSON does not set keep
lightning_zero's defaults (see ``docs/deepspeed_config.md``). ``given`` names each setting the JSON
sets by its Hydra key (``zero.stage``, ``precision.name``, ...) with the JSON key that set it: the
precedence checks of the strategy and of ``lightning-zero train`` use it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_zero.core.settings.expert import ExpertParallelConfig
from lightning_zero.core.settings.offload import DEFAULT_BUFFER_COUNT, DEFAULT_MAX_IN_CPU, OffloadConfig
from lightning_zero.core.settings.precision import LossScalerConfig, PrecisionConfig
from lightning_zero.core.settings.rules import settings_problems
from lightning_zero.core.settings.tensor import TensorParallelConfig
from lightning_zero.core.settings.tree import ParallelSettings, Settings
from lightning_zero.core.settings.zero import ZeroConfig
from lightning_zero.deepspeed.batch import GAS, MICRO, TBS, BatchSizes
from lightning_zero.deepspeed.json_section import AUTO, JsonSection, Problems, load_json, refuse_nulls
from lightning_zero.deepspeed.optim import optimizer_recipe
from lightning_zero.deepspeed.pipeline import PipelineSpec, parse_pipeline
from lightning_zero.deepspeed.refused import REFUSED, refusal_message, refuse_unbuilt, refused_keys
from lightning_zero.deepspeed.schedulers import check_scheduler_params
from lightning_zero.deepspeed.tensor_parallel import SECTION, parse_tensor_parallel
from lightning_zero.moe.config import DEEPSPEED_SECTION, expert_parallel_from_deepspeed

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
# key -> values lightning_zero accepts as "what it does anyway"; any other value is unsupported
_NOOP_TOP = {"prescale_gradients": (False,), "gradient_predivide_factor": (1, 1.0), "sparse_gradients": (False,),
             "zero_allow_untested_optimizer": (False,), "zero_force_ds_cpu_optimizer": (True, False),
             "memory_breakdown": (False,), "dump_state": (False,), "disable_allgather": (False,)}
_NOOP_ZERO = {"contiguous_gradients": (True,), "allgather_partitions": (True,), "ignore_unused_parameters": (True,),
              "round_robin_gradients": (False,), "elastic_checkpoint": (False,), "load_from_fp32_weights": (True,),
              "stage3_gather_16bit_weights_on_model_save": (False,),
              "stage3_gather_fp16_weights_on_model_save": (False,), "zero_hpz_partition_size": (1,),
              "zero_quantized_weights": (False,), "zero_quantized_gradients": (False,)}
_ZERO_KEYS = {"stage": "stage", "reduce_bucket_size": "reduce_bucket_size", "overlap_comm": "overlap_comm",
              "stage3_prefetch_bucket_size": "prefetch_bucket_size",
              "stage3_max_live_parameters": "max_live_parameters",
              "stage3_max_reuse_distance": "max_reuse_distance",
              "stage3_param_persistence_threshold": "param_persistence_threshold"}
# DeepSpeed types min_loss_scale and loss_scale_window as integers (a fractional value is refused there too)
_SCALER_KEYS = {"loss_scale": float, "initial_scale_power": int, "loss_scale_window": int, "hysteresis": int,
                "consecutive_hysteresis": bool, "min_loss_scale": int}


@dataclass(frozen=True)
class SectionSpec:
    """An ``optimizer`` or ``scheduler`` section: its ``type`` and ``params``."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A parsed DeepSpeed config. Fields the JSON does not set hold lightning_zero's defaults (or ``None``).

    Attributes:
        zero: the ZeRO settings (``zero_optimization``).
        offload: ``zero_optimization.offload_optimizer`` / ``offload_param``.
        precision: ``"16-mixed"`` (``fp16``), ``"bf16-mixed"`` (``bf16``) or ``None`` (not set).
        loss_scaler: ``fp16``'s scaler keys (``None`` unless fp16 is enabled).
        reduce_dtype: ``communication_data_type``; grad_accum_dtype: ``data_types.grad_accum_dtype``.
        batch: the batch-size keys as given (resolved against a world size later).
        gradient_clipping: global-norm clipping (``None``: off / not set).
        optimizer, scheduler: the sections, validated (types known, params accepted).
        steps_per_print, wall_clock_breakdown: progress and timing lines on rank 0.
        pipeline: the ``pipeline`` section (``deepspeed/pipeline.py``; ``None``: absent).
        sequence_parallel: ``sequence_parallel_size`` (docs/sequence_parallel.md; 1: off).
        tensor_parallel: ``tensor_parallel.autotp_size`` (docs/tensor_parallel.md; 1: off).
        expert_parallel: ``expert_parallel.autoep_size`` when ``enabled`` (docs/expert_parallel.md; 1: off).
        sparse_attention: the ``sparse_attention`` section, checked (``None``: absent); the GPT
            experiment's attention (docs/sparse_attention.md).
        given: Hydra-style setting name -> the JSON key that set it.
        unsupported: JSON keys (``key=value`` for unsupported values) that are ignored.
        source: the file, or ``"<dict>"``.
    """

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    precision: str | None = None
    loss_scaler: LossScalerConfig | None = None
    reduce_dtype: torch.dtype | None = None
    grad_accum_dtype: torch.dtype | None = None
    batch: BatchSizes = field(default_factory=BatchSizes)
    gradient_clipping: float | None = None
    optimizer: SectionSpec | None = None
    scheduler: SectionSpec | None = None
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    pipeline: PipelineSpec | None = None
    sparse_attention: dict[str, Any] | None = None
    sequence_parallel: int = 1
    tensor_parallel: int = 1
    expert_parallel: int = 1
    given: dict[str, str] = field(default_factory=dict)
    unsupported: tuple[str, ...] = ()
    source: str = "<dict>"

    def precision_settings(self, default: str | None = None) -> PrecisionConfig | None:
        """The precision node the JSON asks for (``None``: it sets no precision). Only what differs from the
        node's defaults is taken (a default ``LossScalerConfig`` is not); ``default`` is the mode when the JSON
        sets only dtypes (else ``"32-true"``)."""
        scaler = self.loss_scaler if self.loss_scaler is not None and self.loss_scaler != LossScalerConfig() else None
        if self.precision is None and scaler is None and self.reduce_dtype is None and self.grad_accum_dtype is None:
            return None
        return PrecisionConfig(self.precision or default or "32-true", scaler, self.reduce_dtype,
                               self.grad_accum_dtype)

    def unsupported_message(self) -> str:
        """The one warning (or strict error) text naming every ignored key."""
        return (f"DeepSpeed config {self.source}: lightning_zero does not support these keys and ignores them: "
                f"{', '.join(self.unsupported)}. Pass strict=True (lightning-zero train: deepspeed_strict=true) "
                "to make this an error. See docs/deepspeed_config.md for the supported keys.")


def parse_deepspeed_config(source: str | Path | Mapping[str, Any], *, strict: bool = False,
                           warn: bool = True) -> DeepSpeedConfig:
    """Parse and validate a DeepSpeed config file or dict.

    Args:
        source: a path to a JSON file, or the config as a dict.
        strict: raise ``ValueError`` on unsupported keys instead of warning.
        warn: emit the unsupported-keys warning here (callers that warn on rank 0 only pass ``False``).

    Raises:
        ValueError: invalid values or combinations (each naming the key), a feature that is not built and would
            change what is computed or stored (``deepspeed/refused.py``), or unsupported keys with ``strict``.
    """
    data, origin = load_json(source)
    refused = refused_keys(data)  # Note [refused, warned, accepted] in deepspeed/refused.py
    if refused:
        raise ValueError(refusal_message(origin, refused))
    unsupported: list[str] = []
    root = JsonSection(data, "", unsupported)
    root.used.update(r.path[0] for r in REFUSED if len(r.path) == 1 and r.path[0] in data)  # present, switched off
    given: dict[str, str] = {}
    problems = Problems()  # every section is read and checked; their problems are raised together
    zero, offload = problems.attempt(lambda: _zero(root, given, unsupported), (ZeroConfig(), OffloadConfig()))
    precision, scaler, reduce_dtype, grad_accum_dtype = problems.attempt(lambda: _precision(root, given),
                                                                         (None, None, None, None))
    batch = problems.attempt(lambda: BatchSizes(root.get(TBS, int), root.get(MICRO, int), root.get(GAS, int)),
                             BatchSizes())
    clip = problems.attempt(lambda: _clipping(root, given), None)
    optimizer, scheduler = problems.attempt(lambda: _sections(root), (None, None))
    steps_per_print, wall_clock = problems.attempt(lambda: _reporting(root), (None, False))
    pipeline = problems.attempt(lambda: parse_pipeline(root.section("pipeline"), given), None)
    sparse_attention = problems.attempt(lambda: _sparse_attention(root, given), None)
    sequence_parallel = problems.attempt(lambda: _sequence_parallel(root, given), 1)
    tensor_parallel = problems.attempt(lambda: parse_tensor_parallel(data.get(SECTION), root.used, unsupported), 1)
    if tensor_parallel > 1:
        given["tensor_parallel.size"] = f"{SECTION}.autotp_size"
    expert_parallel = problems.attempt(
        lambda: expert_parallel_from_deepspeed(data.get(DEEPSPEED_SECTION), root.used, unsupported), 1)
    if expert_parallel > 1:
        given["expert_parallel.size"] = f"{DEEPSPEED_SECTION}.autoep_size"
    # the rules across the nodes the JSON sets (its pipeline joins them in the strategy, with the batch)
    problems.add(settings_problems(Settings(zero=zero, offload=offload, parallel=ParallelSettings(
        None, TensorParallelConfig(tensor_parallel), sequence_parallel,
        ExpertParallelConfig(expert_parallel) if expert_parallel > 1 else None)), json_keys(given=given)))
    problems.raise_any(origin)
    root.noop(_NOOP_TOP)
    amp = root.section("amp")
    if amp is not None:
        amp.noop({"enabled": (False,)})
        amp.finish()
    root.finish()
    config = DeepSpeedConfig(zero=zero, offload=offload, precision=precision, loss_scaler=scaler,
                             reduce_dtype=reduce_dtype, grad_accum_dtype=grad_accum_dtype, batch=batch,
                             gradient_clipping=clip or None, optimizer=optimizer, scheduler=scheduler,
                             steps_per_print=steps_per_print, wall_clock_breakdown=wall_clock, pipeline=pipeline,
                             sparse_attention=sparse_attention, sequence_parallel=sequence_parallel,
                             tensor_parallel=tensor_parallel, expert_parallel=expert_parallel, given=given,
                             unsupported=tuple(unsupported), source=origin)
    if config.unsupported and strict:
        raise ValueError(config.unsupported_message())
    if config.unsupported and warn:
        warnings.warn(config.unsupported_message(), UserWarning, stacklevel=2)
    return config


def _clipping(root: JsonSection, given: dict[str, str]) -> float | None:
    clip = root.get("gradient_clipping", float)
    if clip is not None and clip < 0:
        raise ValueError(f"DeepSpeed config: `gradient_clipping` must be >= 0, got {clip}.")
    if clip:
        given["trainer.gradient_clip_val"] = "gradient_clipping"
    return clip


def _sections(root: JsonSection) -> tuple[SectionSpec | None, SectionSpec | None]:
    """The ``optimizer`` and ``scheduler`` sections, their types and params checked."""
    optimizer, scheduler = _spec(root, "optimizer"), _spec(root, "scheduler")
    if optimizer is not None:
        optimizer_recipe(optimizer.type, optimizer.params)  # unknown types / params fail here, before any run
    if scheduler is not None:
        check_scheduler_params(scheduler.type, scheduler.params)
    return optimizer, scheduler


def _reporting(root: JsonSection) -> tuple[int | None, bool]:
    steps_per_print = root.get("steps_per_print", int)
    if steps_per_print is not None and steps_per_print < 1:
        raise ValueError(f"DeepSpeed config: `steps_per_print` must be >= 1, got {steps_per_print}.")
    return steps_per_print, root.get("wall_clock_breakdown", bool, False)


def _sequence_parallel(root: JsonSection, given: dict[str, str]) -> int:
    size = root.get("sequence_parallel_size", int, 1)
    if size < 1:
        raise ValueError(f"DeepSpeed config: `sequence_parallel_size` must be >= 1, got {size}.")
    if "sequence_parallel_size" in root.data:
        given["sequence_parallel.size"] = "sequence_parallel_size"
    return size


def _sparse_attention(root: JsonSection, given: dict[str, str]) -> dict[str, Any] | None:
    """The ``sparse_attention`` section, its mode and keys checked (lightning_zero.sparse_attention)."""
    from lightning_zero.sparse_attention import check_section

    raw = root.data.get("sparse_attention")
    root.used.add("sparse_attention")
    if raw is None:
        return None
    try:
        section = check_section(raw)
    except (ValueError, NotImplementedError) as err:
        raise ValueError(f"DeepSpeed config: {err}") from err
    given["model.sparse_attention"] = "sparse_attention"
    return section


def _spec(root: JsonSection, name: str) -> SectionSpec | None:
    section = root.section(name)
    if section is None:
        return None
    kind = section.get("type", str)
    if kind is None:
        raise ValueError(f"DeepSpeed config: `{name}.type` is required.")
    params = section.get("params", dict, {})
    section.noop({"legacy_fusion": (False,)})
    section.finish()
    return SectionSpec(kind, {k: v for k, v in params.items() if v != AUTO})


def _zero(root: JsonSection, given: dict[str, str], unsupported: list[str]) -> tuple[ZeroConfig, OffloadConfig]:
    root.used.add("zero_optimization")
    raw = root.data.get("zero_optimization")
    if isinstance(raw, bool):  # DeepSpeed's legacy form: true = stage 1
        raw = {"stage": int(raw)}
    if raw is None:
        return ZeroConfig(), OffloadConfig()
    z = JsonSection(raw, "zero_optimization", unsupported)
    kwargs: dict[str, Any] = {}
    for key, name in _ZERO_KEYS.items():
        value = z.get(key, bool if name == "overlap_comm" else int)
        if value is not None:
            kwargs[name] = value
            given[f"zero.{name}"] = z.key(key)
    reduce_scatter = z.get("reduce_scatter", bool)
    if reduce_scatter is not None:
        kwargs["collective"] = "reduce_scatter" if reduce_scatter else "all_reduce"
        given["zero.collective"] = z.key("reduce_scatter")
    try:
        zero = ZeroConfig(**kwargs)
    except ValueError as err:
        raise ValueError(f"DeepSpeed config: zero_optimization: {err}") from err
    offload = _offload(z, given)
    z.noop(_NOOP_ZERO)
    z.finish()
    return zero, offload


def _offload(z: JsonSection, given: dict[str, str]) -> OffloadConfig:
    values: dict[str, Any] = {}
    sub_group = z.get("sub_group_size", int)
    if sub_group is not None:  # elements stepped and swapped at once (docs/offload.md)
        values["sub_group_size"] = sub_group
        given["offload.sub_group_size"] = z.key("sub_group_size")
    if z.get("cpu_offload", bool):  # DeepSpeed's legacy switch for offload_optimizer.device=cpu
        values["optimizer_device"] = "cpu"
        given["offload.optimizer_device"] = z.key("cpu_offload")
    shared = {"nvme_path": str, "pin_memory": bool}
    for kind in ("optimizer", "param"):
        section = z.section(f"offload_{kind}")
        if section is None:
            continue
        if kind == "optimizer" and section.data.get("device") == "nvme":  # the nvme step's swap buffers and
            # pipeline, DeepSpeed's defaults when not given (Note [swapped step]); unused by the cpu device
            values["buffer_count"] = section.get("buffer_count", int, DEFAULT_BUFFER_COUNT)
            values["pipeline_read"] = section.get("pipeline_read", bool, False)
            values["pipeline_write"] = section.get("pipeline_write", bool, False)
            for key in ("buffer_count", "pipeline_read", "pipeline_write"):  # given, as DeepSpeed's defaults if
                given[f"offload.{key}"] = section.key(key)  # absent: the JSON decides them
        elif kind == "optimizer":
            section.noop({"buffer_count": (DEFAULT_BUFFER_COUNT,), "pipeline_read": (False,),
                          "pipeline_write": (False,)})
        else:
            refuse_unbuilt(section.key("buffer_count"), section.get("buffer_count", int), 5)
            refuse_unbuilt(section.key("buffer_size"), section.get("buffer_size", int), 100_000_000)
            refuse_unbuilt(section.key("max_in_cpu"), section.get("max_in_cpu", int), DEFAULT_MAX_IN_CPU)
        device = section.get("device", str, "none")
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"DeepSpeed config: `{section.key('device')}` must be none, cpu or nvme, got {device!r}.")
        values[f"{kind}_device"] = device
        given[f"offload.{kind}_device"] = section.key("device")
        for key, typ in shared.items():
            value = section.get(key, typ)
            if value is None:
                continue
            if key in values and values[key] != value:
                raise ValueError(f"DeepSpeed config: `{section.key(key)}`={value!r} differs from "
                                 f"`{given[f'offload.{key}']}`={values[key]!r}; lightning_zero has one {key} for "
                                 "both offloads. Fix: give both the same value.")
            values[key] = value
            given.setdefault(f"offload.{key}", section.key(key))
        section.noop({"fast_init": (False,), "ratio": (1, 1.0)})
        section.finish()
    return OffloadConfig(**values)


def json_keys(ds: DeepSpeedConfig | None = None, given: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings tree's keys as a DeepSpeed JSON writes them (Note [one rule, many spellings] in
    ``core/settings/rules.py``): the keys ``ds`` (or ``given``) set, else DeepSpeed's names for them."""
    named = dict(ds.given if ds is not None else given or {})
    return {"zero.stage": named.get("zero.stage", "zero_optimization.stage"),
            "offload.optimizer_device": named.get("offload.optimizer_device",
                                                  "zero_optimization.offload_optimizer.device"),
            "offload.param_device": named.get("offload.param_device", "zero_optimization.offload_param.device"),
            "offload.nvme_path": named.get("offload.nvme_path", "zero_optimization.offload_optimizer.nvme_path"),
            "parallel.pipeline": named.get("pipeline.stages", "pipeline.stages"),
            "parallel.tensor": named.get("tensor_parallel.size", f"{SECTION}.autotp_size"),
            "parallel.sequence": named.get("sequence_parallel.size", "sequence_parallel_size"),
            "parallel.expert": named.get("expert_parallel.size", f"{DEEPSPEED_SECTION}.autoep_size"),
            "pipeline.reduce_per_micro_batch": "pipeline.reduce_per_micro_batch"}


def _precision(root: JsonSection, given: dict[str, str]) -> tuple[str | None, LossScalerConfig | None,
                                                              torch.dtype | None, torch.dtype | None]:
    nulls = [k for k in ("fp16", "bf16", "bfloat16") if k in root.data and root.data[k] is None]
    if nulls:
        raise ValueError(f"DeepSpeed config: `{nulls[0]}` is null. Give it an object, or leave it out.")
    fp16 = root.section("fp16")
    bf16 = root.section("bf16")
    alias = root.section("bfloat16")  # DeepSpeed's older name of the bf16 section
    if bf16 is None:
        bf16 = alias
    elif alias is not None:
        raise ValueError("DeepSpeed config: both `bf16` and `bfloat16` sections; keep one (`bf16`).")
    precision, scaler = None, None
    for section in (fp16, bf16):
        refuse_nulls(section)
    fp16_on = fp16 is not None and fp16.get("enabled", bool, False)
    bf16_on = bf16 is not None and bf16.get("enabled", bool, False)
    if fp16_on and bf16_on:
        raise ValueError("DeepSpeed config: fp16.enabled and bf16.enabled are both true; enable one.")
    if fp16 is not None:
        knobs = {k: fp16.get(k, t) for k, t in _SCALER_KEYS.items()}
        fp16.noop({"auto_cast": (False,), "fp16_master_weights_and_grads": (False,)})
        fp16.finish()
        set_knobs = {k: v for k, v in knobs.items() if v is not None}
        try:  # DeepSpeed validates the section even when fp16 is off (the dynamic-only knobs only when in use)
            # off: only loss_scale and min_loss_scale's finiteness (a static stand-in skips the dynamic checks)
            checked = LossScalerConfig(**set_knobs) if fp16_on else LossScalerConfig(
                loss_scale=set_knobs.get("loss_scale") or 1.0, min_loss_scale=set_knobs.get("min_loss_scale", 1))
        except ValueError as err:
            raise ValueError(f"DeepSpeed config: fp16: {err}") from err
        if fp16_on:
            precision, scaler = "16-mixed", checked
            given["precision.name"] = fp16.key("enabled")
            given.update({f"precision.{k}": fp16.key(k) for k in set_knobs})
    if bf16 is not None:
        bf16.noop({"immediate_grad_update": (True, False)})
        bf16.finish()
        if bf16_on:
            precision = "bf16-mixed"
            given["precision.name"] = bf16.key("enabled")
    reduce_dtype = _dtype(root.get("communication_data_type", str), "communication_data_type")
    types = root.section("data_types")
    grad_accum = None
    if types is not None:
        grad_accum = _dtype(types.get("grad_accum_dtype", str), "data_types.grad_accum_dtype")
        types.finish()
    if reduce_dtype is not None:
        given["precision.reduce_dtype"] = "communication_data_type"
    if grad_accum is not None:
        given["precision.grad_accum_dtype"] = "data_types.grad_accum_dtype"
    return precision, scaler, reduce_dtype, grad_accum


def _dtype(name: str | None, key: str) -> torch.dtype | None:
    if name is None:
        return None
    if name.lower() not in _DTYPES:
        raise ValueError(f"DeepSpeed config: `{key}` must be one of fp32, fp16, bf16, got {name!r}.")
    return _DTYPES[name.lower()]

