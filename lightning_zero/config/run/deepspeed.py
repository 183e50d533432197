"""``lightning-zero train deepspeed_config=path/to/ds.json``: a DeepSpeed JSON over the composed Hydra config.

Precedence (also in ``docs/deepspeed_config.md``):

* Every setting the JSON gives replaces the composed config's value where that came from a group's
  YAML default (``precision: fp32`` of ``config.yaml``, the default experiment's group choices, ...):
  defaults are not settings.
* A setting the user **wrote** -- on the command line, or in the ``experiment/`` file chosen on the
  command line (``experiment=gpt_tiny``) -- must agree with the JSON, else the command stops (exit
  code 2, nothing started) with one message naming both places. Written means a key
  (``zero.stage=1``, ``data.micro_batch_size: 8`` in the experiment, ...) or a group choice for the
  keys that define the option: ``zero=...`` / ``override /zero: ...`` sets ``zero.stage``,
  ``offload=...`` the two offload devices, ``precision=...`` ``precision.name``, ``pipeline=...``
  ``pipeline.stages``.
* The batch triple is resolved against the data-parallel size ``trainer.devices / pipeline.stages``
  before anything starts; it sets ``data.micro_batch_size`` and ``trainer.accumulate_grad_batches``,
  or, pipelined (``pipeline.stages`` > 1, from the JSON's ``pipeline`` section or the command line),
  ``pipeline.micro_batches`` = the accumulation steps, ``data.micro_batch_size`` = micro-batch x
  accumulation steps and no accumulation (Note [DeepSpeed pipeline batches] in deepspeed/pipeline.py).
  The JSON's ``pipeline`` keys set ``pipeline.stages`` / ``partition_method`` /
  ``activation_checkpoint_interval``; a pipeline the JSON starts gets 1F1B (GPipe below ``stages``
  micro-batches).
* A JSON ``optimizer`` / ``scheduler`` section replaces the model's optimizer / schedule
  (``optimizer_source="config"``), so ``model.optimizer``, ``model.lr``, ``model.weight_decay``,
  ``model.betas`` (resp. ``model.scheduler``, ``model.warmup_steps``, ``model.lr_decay_steps``,
  ``model.min_lr_ratio``) may not be given on the command line with it.

The merged config is what the ranks read (``config.yaml``); it keeps ``deepspeed_config`` (made
absolute), from which each rank builds the strategy with ``DeepSpeedZeroStrategy.from_deepspeed_config``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_zero.config.paths import conf_dir
from lightning_zero.config.schema import TrainConfig
from lightning_zero.core.mesh.dims import ParallelDims
from lightning_zero.deepspeed.batch import GAS, MICRO, TBS, ResolvedBatch
from lightning_zero.deepspeed.config import DeepSpeedConfig, parse_deepspeed_config
from lightning_zero.deepspeed.pipeline import pipeline_batch

GROUP_KEYS = {"zero": ("zero.stage",), "offload": ("offload.optimizer_device", "offload.param_device"),
              "precision": ("precision.name",), "pipeline": ("pipeline.stages",),
              "sequence_parallel": ("sequence_parallel.size",), "tensor_parallel": ("tensor_parallel.size",),
              "expert_parallel": ("expert_parallel.size",)}
HYDRA_PRECISION = {"16-mixed": "fp16", "bf16-mixed": "bf16"}
OPTIMIZER_KEYS = ("model.optimizer", "model.lr", "model.weight_decay", "model.betas")
SCHEDULER_KEYS = ("model.scheduler", "model.warmup_steps", "model.lr_decay_steps", "model.min_lr_ratio")


def explicit_keys(overrides: Sequence[str]) -> set[str]:
    """The dotted config keys a command line sets explicitly (see the module docs for group choices)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out: set[str] = set()
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        out.update(GROUP_KEYS.get(key, (key,)))
    return out


def explicit_sources(overrides: Sequence[str]) -> dict[str, str]:
    """Each config key the user wrote -> where: ``"on the command line"`` or ``"in experiment/NAME.yaml"``
    (the experiment chosen on the command line; the command line wins where both set a key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.key_or_group == "experiment" and isinstance(override.value(), str):
            name = str(override.value())
            out.update(dict.fromkeys(experiment_keys(name), f"in experiment/{name}.yaml"))
    out.update(dict.fromkeys(explicit_keys(overrides), "on the command line"))
    return out


def experiment_keys(name: str) -> set[str]:
    """The dotted keys the experiment file ``NAME.yaml`` under ``conf/experiment/`` sets (its group
    overrides as the keys they define)."""
    path = conf_dir() / "experiment" / f"{name}.yaml"
    if not path.is_file():
        return set()  # Hydra's composition has refused an unknown experiment already
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(data, dict)
    out: set[str] = set()
    for entry in data.pop("defaults", None) or []:
        for choice in entry if isinstance(entry, dict) else {}:
            group = str(choice).replace("override", "").strip().lstrip("/")
            out.update(GROUP_KEYS.get(group, ()))

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out.add(prefix.rstrip("."))

    walk(data, "")
    return out


def json_settings(ds: DeepSpeedConfig) -> dict[str, Any]:
    """The Hydra key -> value of every setting the JSON gives that has a Hydra key (batch keys excepted)."""
    out: dict[str, Any] = {}
    for name in ds.given:
        group, _, key = name.partition(".")
        if group in ("zero", "offload"):  # plain numbers and strings, as the Hydra options hold them
            out[name] = _plain(getattr(ds.zero if group == "zero" else ds.offload, key))
        elif name == "precision.name":
            out[name] = HYDRA_PRECISION[ds.precision or ""]
        elif group == "precision" and ds.loss_scaler is not None and hasattr(ds.loss_scaler, key):
            out[name] = getattr(ds.loss_scaler, key)
        elif name == "trainer.gradient_clip_val":
            out[name] = ds.gradient_clipping
        elif group == "pipeline" and ds.pipeline is not None:
            out[name] = getattr(ds.pipeline, key)
        elif name == "model.sparse_attention":
            out[name] = ds.sparse_attention
        elif name == "sequence_parallel.size":
            out[name] = ds.sequence_parallel
        elif name == "tensor_parallel.size":
            out[name] = ds.tensor_parallel
        elif name == "expert_parallel.size":
            out[name] = ds.expert_parallel
    return out


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def apply_deepspeed_config(cfg: DictConfig | TrainConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """``cfg`` with the settings of its ``deepspeed_config`` JSON merged in (``cfg`` itself is not changed).

    Args:
        cfg: a composed config (or a typed one); without ``deepspeed_config`` it is returned as a DictConfig.
        overrides: the command line's overrides, to tell explicit settings from defaults.

    Raises:
        ValueError: a command-line setting contradicts the JSON (every conflict listed), the batch triple
            does not fit the data-parallel size, or the JSON itself is invalid (strict: unsupported keys).
    """
    node = OmegaConf.structured(cfg) if isinstance(cfg, TrainConfig) else copy.deepcopy(cfg)
    path = OmegaConf.select(node, "deepspeed_config")
    if not path:
        return node
    # the unsupported-keys warning is rank 0's, when it builds the strategy: printed once, not per check here
    ds = parse_deepspeed_config(path, strict=bool(OmegaConf.select(node, "deepspeed_strict")), warn=False)
    written = explicit_sources(overrides)
    explicit = {k for k, where in written.items() if where == "on the command line"}
    settings = {name: (value, f"{ds.given[name]}=true (precision {value})" if name == "precision.name"
                       else f"{ds.given[name]}={value!r}") for name, value in json_settings(ds).items()}
    json_stages = ds.pipeline.stages if ds.pipeline is not None else None
    devices, stages = int(node.trainer.devices), max(1, json_stages or int(node.pipeline.stages))
    sequence = ds.sequence_parallel if "sequence_parallel.size" in ds.given else int(node.sequence_parallel.size)
    tensor = ds.tensor_parallel if "tensor_parallel.size" in ds.given else int(node.tensor_parallel.size)
    try:  # over the data-parallel ranks: a pipeline's stages, a sequence or a tensor group share their samples
        dims = ParallelDims(devices, pipeline=stages, sequence=max(1, sequence), tensor=max(1, tensor))
        batch = ds.batch.resolve(dims.data)  # the mesh's data dimension: the one place it is derived
    except ValueError as err:
        raise ValueError(f"DeepSpeed config {ds.source} with trainer.devices={devices}"
                         f"{f' / pipeline.stages={stages}' if stages > 1 else ''}: {err}") from err
    if batch is not None and stages > 1 and not ds.batch.gives_accumulation:
        m = int(node.pipeline.micro_batches)  # only the micro-batch size given: the pipeline's micro_batches stay
        batch = replace(batch, accumulation_steps=m, train_batch_size=batch.micro_batch_size * m * batch.world_size)
    if batch is not None:
        how = f"{TBS}={batch.train_batch_size} over {batch.world_size} data-parallel rank(s)"
        if stages > 1:  # Note [DeepSpeed pipeline batches] in deepspeed/pipeline.py
            settings.update(_pipeline_batch_settings(batch, how))
        else:
            settings["data.micro_batch_size"] = (batch.micro_batch_size, f"{MICRO}={batch.micro_batch_size} ({how})")
            settings["trainer.accumulate_grad_batches"] = (batch.accumulation_steps,
                                                           f"{GAS}={batch.accumulation_steps} ({how})")
    problems = []
    for name, (value, source) in settings.items():
        current = _plain(OmegaConf.select(node, name))
        if name in written and current != value:
            problems.append(f"{name}={current!r} {written[name]}, but the DeepSpeed config {ds.source} "
                            f"gives {source}. Set it in one place (or to the same value).")
        else:
            OmegaConf.update(node, name, value, merge=False)
    for section, keys in (("optimizer", OPTIMIZER_KEYS), ("scheduler", SCHEDULER_KEYS)):
        if getattr(ds, section) is None:
            continue
        for name in sorted(explicit.intersection(keys)):
            problems.append(f"{name} on the command line, but the DeepSpeed config {ds.source} has a `{section}` "
                            f"section, which replaces the model's. Set it in `{section}.params` (or drop the section).")
    if problems:
        raise ValueError("conflicting settings:\n  - " + "\n  - ".join(problems))
    if stages > 1 and _plain(OmegaConf.select(node, "pipeline.schedule")) == "none":  # the JSON made the pipeline
        m = int(node.pipeline.micro_batches)
        OmegaConf.update(node, "pipeline.schedule", "one_f_one_b" if m >= stages else "gpipe", merge=False)
    return node


def _pipeline_batch_settings(batch: ResolvedBatch, how: str) -> dict[str, tuple[Any, str]]:
    """The batch triple as DeepSpeed's pipeline engine reads it: GAS micro-batches per step, one batch of
    micro x GAS samples per data-parallel rank, no accumulation by Lightning."""
    micro_batches, per_rank = pipeline_batch(batch)
    engine = "DeepSpeed's pipeline engine runs that many micro-batches per step"
    return {
        "pipeline.micro_batches": (micro_batches, f"{GAS}={micro_batches} ({engine}; {how})"),
        "data.micro_batch_size": (per_rank, f"{MICRO}={batch.micro_batch_size} x {GAS}={micro_batches} = {per_rank} "
                                            f"samples per data-parallel rank and step ({how})"),
        "trainer.accumulate_grad_batches": (1, f"{GAS}={micro_batches} as pipeline micro-batches, so Lightning "
                                               "accumulates nothing"),
    }
