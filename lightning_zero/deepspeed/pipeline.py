"""DeepSpeed JSON's top-level ``pipeline`` section, and what DeepSpeed's batch keys mean under a pipeline.

Note [DeepSpeed pipeline keys]
    DeepSpeed 0.19.8 fills the section with ``{"stages": "auto", "partition": "best", "seed_layers":
    false, "activation_checkpoint_interval": 0, "pipe_partitioned": true, "grad_partitioned": true}``
    and takes the user's keys over it. Its ``PipelineEngine`` reads ``activation_checkpoint_interval``,
    ``use_reentrant``, ``pipe_partitioned`` and ``grad_partitioned``; the stage count, partition method
    and ``seed_layers`` are ``PipelineModule``'s constructor arguments (``num_stages``,
    ``partition_method``, ``seed_layers``). Here the section configures the pipeline itself:

    * ``stages`` -> ``PipelineConfig.stages`` (``"auto"``: not set);
    * ``partition`` or ``partition_method`` -> ``partition_method`` (``parameters``, ``uniform``,
      ``type:<regex>``; DeepSpeed's default ``"best"`` counts as not set; ``profile``, which DeepSpeed
      does not implement either, is refused);
    * ``activation_checkpoint_interval`` -> ``activation_checkpoint_interval``;
    * ``pipe_partitioned`` / ``grad_partitioned``: accepted either way, they act only with tensor
      parallelism (DeepSpeed: ``is_model_parallel``), and the tensor-parallel size is 1 here;
    * ``seed_layers: false`` and ``use_reentrant: false`` accepted; ``true`` is ignored with a warning
      (no per-layer reseeding in ``__init__``: a ``configure_model`` build seeds every module from its
      name anyway; activation checkpointing is non-reentrant here);
    * anything else is ignored with a warning.

Note [DeepSpeed pipeline batches]
    DeepSpeed's ``PipelineEngine.train_batch`` runs ``gradient_accumulation_steps`` micro-batches of
    ``train_micro_batch_size_per_gpu`` samples per optimizer step (``micro_batches =
    gradient_accumulation_steps()``). A pipelined run here takes the same: ``micro_batches`` = the
    accumulation steps, the batch per data-parallel rank (``data.micro_batch_size``, the DataLoader's
    ``batch_size``) = micro-batch size x accumulation steps, and Lightning accumulates nothing
    (``accumulate_grad_batches=1``). The data-parallel size is the world size / ``stages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_zero.core.settings.pipeline import PipelineConfig
from lightning_zero.deepspeed.batch import GAS, BatchSizes, ResolvedBatch

SECTION = "pipeline"
_NOOP = {"seed_layers": (False,), "use_reentrant": (False,)}
_TENSOR_PARALLEL_ONLY = ("pipe_partitioned", "grad_partitioned")  # either value; a bool, as DeepSpeed asserts
_NOT_SET = ("best",)  # DeepSpeed's default "partition", which PipelineModule never reads


@dataclass(frozen=True)
class PipelineSpec:
    """What a JSON ``pipeline`` section sets (``None``: not set)."""

    stages: int | None = None
    partition_method: str | None = None
    activation_checkpoint_interval: int | None = None

    def apply(self, base: PipelineConfig | None, micro_batches: int | None) -> PipelineConfig | None:
        """``base`` (the caller's pipeline, or none) with the JSON's fields and ``micro_batches`` (Note
        [DeepSpeed pipeline batches]); ``None`` when neither asks for more than one stage. Without a
        schedule of the caller's, 1F1B (DeepSpeed's TrainSchedule) where it can run, else GPipe."""
        stages = self.stages or (base.stages if base is not None else 1)
        if stages <= 1:
            return None
        values: dict[str, Any] = {"stages": stages}
        if self.partition_method is not None:
            values["partition_method"] = self.partition_method
        if self.activation_checkpoint_interval is not None:
            values["activation_checkpoint_interval"] = self.activation_checkpoint_interval
        m = micro_batches or (base.micro_batches if base is not None else 1)
        values["micro_batches"] = m
        if base is None:
            return PipelineConfig(schedule="1f1b" if m >= stages else "gpipe", **values)
        return PipelineConfig(**{**base.__dict__, **values})


def parse_pipeline(section: Any, given: dict[str, str]) -> PipelineSpec | None:
    """The ``pipeline`` section (a ``json_section.JsonSection``; ``None``: absent), recording ``given`` keys."""
    if section is None:
        return None
    stages = section.get("stages", int)
    if stages is not None and stages < 1:
        raise ValueError(f"DeepSpeed config: `{section.key('stages')}` must be >= 1 (or \"auto\"), got {stages}.")
    methods = {k: section.get(k, str) for k in ("partition", "partition_method")}
    methods = {k: v for k, v in methods.items() if v is not None and v not in _NOT_SET}
    if len(set(methods.values())) > 1:
        raise ValueError(f"DeepSpeed config: `{section.key('partition')}` and `{section.key('partition_method')}` "
                         f"differ ({methods}); give one.")
    method = next(iter(methods.values()), None)
    if method == "profile":
        raise ValueError(f"DeepSpeed config: `{section.key(next(iter(methods)))}`=\"profile\" is not implemented "
                         "(nor is it in DeepSpeed). Use \"parameters\", \"uniform\" or \"type:<regex>\".")
    interval = section.get("activation_checkpoint_interval", int)
    spec = PipelineSpec(stages, method, interval)
    try:
        PipelineConfig(stages=stages or 2, micro_batches=stages or 2, partition_method=method or "parameters",
                       activation_checkpoint_interval=interval or 0)
    except ValueError as err:
        raise ValueError(f"DeepSpeed config: `{SECTION}`: {err}") from err
    for name, key in (("stages", "stages"), ("partition_method", next(iter(methods), None)),
                      ("activation_checkpoint_interval", "activation_checkpoint_interval")):
        if getattr(spec, name) is not None and key is not None:
            given[f"pipeline.{name}"] = section.key(key)
    for key in _TENSOR_PARALLEL_ONLY:
        section.get(key, bool)
    section.noop(_NOOP)
    section.finish()
    return spec


def pipeline_batch(batch: ResolvedBatch) -> tuple[int, int]:
    """``(micro_batches, batch per data-parallel rank)`` of a resolved triple under a pipeline (Note
    [DeepSpeed pipeline batches])."""
    return batch.accumulation_steps, batch.micro_batch_size * batch.accumulation_steps


def _conflicts(problems: list[str]) -> None:
    if problems:
        raise ValueError("conflicting settings:\n  - " + "\n  - ".join(problems))


def merged_pipeline(spec: PipelineSpec | None, batch: BatchSizes, base: PipelineConfig | None,
                    source: str) -> PipelineConfig | None:
    """``from_deepspeed_config``: the caller's ``pipeline=`` (``base``) with the JSON's ``pipeline`` keys and
    its ``gradient_accumulation_steps`` as micro-batches; a value set in both places must agree."""
    problems = []
    for name in ("stages", "partition_method", "activation_checkpoint_interval"):
        value = getattr(spec, name) if spec is not None else None
        if base is not None and value is not None and getattr(base, name) != value:
            problems.append(f"the DeepSpeed config {source} sets pipeline.{name}={value!r}, but "
                            f"pipeline=PipelineConfig({name}={getattr(base, name)!r}). Set it in one place.")
    gas = batch.accumulation_steps
    if base is not None and base.stages > 1 and gas is not None and base.micro_batches != gas:
        problems.append(_micro_batch_conflict(source, gas, base.micro_batches))
    _conflicts(problems)
    return spec.apply(base, gas) if spec is not None else base


def pipeline_for_batch(config: PipelineConfig, batch: ResolvedBatch, from_json: bool, source: str) -> PipelineConfig:
    """At setup (the world size known): ``micro_batches`` = the accumulation steps (derived from
    ``train_batch_size``); a pipeline the JSON made takes them, the caller's must agree."""
    gas = batch.accumulation_steps
    if config.micro_batches == gas:
        return config
    if not from_json:
        _conflicts([_micro_batch_conflict(source, gas, config.micro_batches)])
    return PipelineConfig(**{**config.__dict__, "micro_batches": gas,
                             "schedule": "1f1b" if gas >= config.stages else "gpipe"})


def _micro_batch_conflict(source: str, gas: int, micro_batches: int) -> str:
    return (f"the DeepSpeed config {source} gives {GAS}={gas}, which a pipeline runs as {gas} micro-batches per step "
            f"(as DeepSpeed's pipeline engine does), but pipeline micro_batches={micro_batches}. Set it in one place.")
