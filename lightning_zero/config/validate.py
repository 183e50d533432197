"""Cross-group checks of a composed config, run before any rank process starts.

:func:`validate_config` is the one gate: a combination that can never work raises ``ValueError``
listing every reason with its fix; a valid combination that needs a feature lightning_zero does
not have yet raises ``NotImplementedError`` naming the feature. Models are only counted on the meta
device here (:func:`describe`), never materialised.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lightning_zero.config.model_zoo import (
    build_module,
    dense_layout_warning,
    epoch_batches,
    gpt_config,
    preset_known,
    resume_problems,
)
from lightning_zero.config.multinode import node_device_problems, resolve_node
from lightning_zero.config.parallel_checks import (
    data_parallel_size,
    expert_parallel_problems,
    pipeline_problems,
    sequence_problems,
    tensor_parallel_problems,
)
from lightning_zero.config.schema import (
    DataSchema,
    GPTModelSchema,
    HFCausalLMSchema,
    MLPModelSchema,
    ModelSchema,
    OffloadDevice,
    OptimizerName,
    PrecisionName,
    PrecisionSchema,
    TeacherDataSchema,
    TextDataSchema,
    TrainConfig,
    to_train_config,
)
from lightning_zero.core.offload.config import (
    DEFAULT_BUFFER_COUNT,
    DEFAULT_MAX_IN_CPU,
    OffloadConfig,
    nvme_path_problem,
)
from lightning_zero.core.precision.loss_scaler import LossScalerConfig
from lightning_zero.core.zero.config import ZeroConfig, ZeroStage
from lightning_zero.core.zero.memory import OFFLOAD_STAGES
from lightning_zero.hf.checks import HFRun, hf_problems
from lightning_zero.project.locate import static_problems
from lightning_zero.project.targets import TargetNode, user_nodes

BUILT_STAGES = tuple(ZeroStage)
_SCALER_KNOBS = tuple(f.name for f in fields(LossScalerConfig))
_DTYPES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16")


def offload_name(cfg: TrainConfig) -> str:
    """The ``offload/`` option the devices amount to (``none``, ``optimizer_cpu``, ``param_nvme``, ...)."""
    opt, par = cfg.offload.optimizer_device, cfg.offload.param_device
    if par is not OffloadDevice.none:
        return f"param_{par.value}"
    return "none" if opt is OffloadDevice.none else f"optimizer_{opt.value}"


def zero_config(cfg: TrainConfig) -> ZeroConfig:
    """The core :class:`ZeroConfig` of ``cfg.zero`` (``elementwise_optimizers`` left out: they are imports)."""
    z = cfg.zero
    return ZeroConfig(stage=z.stage, reduce_bucket_size=int(z.reduce_bucket_size), overlap_comm=z.overlap_comm,
                      collective=z.collective.value, timeout_s=z.timeout_s,
                      hang_timeout_s=z.hang_timeout_s, nonfinite=z.nonfinite,
                      prefetch_bucket_size=int(z.prefetch_bucket_size), max_live_parameters=int(z.max_live_parameters),
                      max_reuse_distance=int(z.max_reuse_distance),
                      param_persistence_threshold=int(z.param_persistence_threshold))


def offload_config(cfg: TrainConfig) -> OffloadConfig:
    """The core :class:`OffloadConfig` of ``cfg.offload`` (what a JSON's offload sections are compared with)."""
    o = cfg.offload
    return OffloadConfig(optimizer_device=o.optimizer_device.value, param_device=o.param_device.value,
                         nvme_path=o.nvme_path, pin_memory=pin_memory(cfg), buffer_count=o.buffer_count,
                         max_in_cpu=int(o.max_in_cpu), sub_group_size=int(o.sub_group_size))


def pin_memory(cfg: TrainConfig) -> bool:
    """``offload.pin_memory``, with ``null`` resolved: pinned where the run has a CUDA accelerator."""
    if cfg.offload.pin_memory is not None:
        return bool(cfg.offload.pin_memory)
    return str(cfg.trainer.accelerator) not in ("cpu",) and torch.cuda.is_available()


def _offload_problems(cfg: TrainConfig) -> list[str]:
    o, stage, name = cfg.offload, cfg.zero.stage, offload_name(cfg)
    out = []
    if o.param_device is not OffloadDevice.none and o.optimizer_device is OffloadDevice.none:
        out.append("offload.param_device is set but offload.optimizer_device is none: parameter offload moves "
                   "the optimizer state too. Fix: offload=param_cpu or offload=param_nvme.")
    elif stage not in OFFLOAD_STAGES[name]:
        what = "offload_param" if name.startswith("param_") else "offload_optimizer"
        needs = "ZeRO stage 3 (partitioned parameters)" if OFFLOAD_STAGES[name] == (3,) else \
            "a partitioned optimizer (ZeRO stage >= 1)"
        fix = "zero=stage3" if OFFLOAD_STAGES[name] == (3,) else "zero=stage1 or higher"
        out.append(f"offload={name} ({what}) needs {needs}, got zero.stage={stage}. Fix: {fix}, or offload=none.")
    if OffloadDevice.nvme in (o.optimizer_device, o.param_device) and not o.nvme_path:
        out.append(f"offload={name} needs offload.nvme_path (a directory on a local NVMe drive).")
    elif OffloadDevice.nvme in (o.optimizer_device, o.param_device):
        problem = nvme_path_problem(str(o.nvme_path), nvme_bytes_per_node(cfg), "offload.nvme_path")
        if problem:  # the check the ranks repeat, here before any of them starts
            out.append(problem)
    if o.buffer_count != DEFAULT_BUFFER_COUNT:  # DeepSpeed's swap-buffer pool: not built (core/offload/config.py)
        out.append(f"offload.buffer_count={o.buffer_count} is not built: there is no pool of swap buffers to size "
                   f"(offload.sub_group_size sets how much is swapped at once). Fix: drop offload.buffer_count (the "
                   f"default is {DEFAULT_BUFFER_COUNT}).")
    if int(o.max_in_cpu) != DEFAULT_MAX_IN_CPU:
        out.append(f"offload.max_in_cpu={o.max_in_cpu} is not built: with offload=param_nvme every offloaded "
                   "parameter shard is on disk. Fix: drop offload.max_in_cpu.")
    return out


def nvme_bytes_per_node(cfg: TrainConfig) -> float:
    """The estimator's bytes of offloaded state under ``offload.nvme_path`` on one node (its ranks share the
    path); 0 when it cannot be counted yet (a stage the offload cannot run, an unknown model: refused apart).

    Args:
        cfg: a composed config with ``"nvme"`` offload.
    """
    from lightning_zero.estimator import ModelSpec, estimate_config, make_cluster

    name, t = offload_name(cfg), cfg.trainer
    gpt = isinstance(cfg.model, GPTModelSchema)
    if (cfg.zero.stage not in OFFLOAD_STAGES.get(name, ()) or (gpt and not preset_known(cfg.model))
            or t.devices < 1 or t.num_nodes < 1):
        return 0.0
    params = count_model_parameters(cfg)
    if params is None:  # not counted before launch: the ranks check the space they need
        return 0.0
    cluster = make_cluster(t.devices * t.num_nodes, t.num_nodes, t.devices)
    estimate = estimate_config(cfg.zero.stage, name, ModelSpec(float(params)), cluster,
                               cfg.precision.name.value)
    return estimate.nvme_bytes * t.devices


def _precision_problems(cfg: TrainConfig) -> list[str]:
    p, out = cfg.precision, []
    defaults = PrecisionSchema()
    changed = [k for k in _SCALER_KNOBS if getattr(p, k) != getattr(defaults, k)]
    if p.name is not PrecisionName.fp16 and changed:
        out.append(f"precision.{', precision.'.join(changed)} set with precision={p.name.value}: loss scaling "
                   "applies to fp16 only. Fix: precision=fp16, or drop those overrides.")
    for key in ("reduce_dtype", "grad_accum_dtype"):
        value = getattr(p, key)
        if value is not None and value not in _DTYPES:
            out.append(f"precision.{key}={value} is not a floating dtype. Fix: one of float32, float16, bfloat16, "
                       "or null (the compute dtype).")
    if p.loss_scale < 0 or p.min_loss_scale <= 0:
        out.append("precision.loss_scale must be >= 0 (0 = dynamic) and precision.min_loss_scale > 0.")
    if not 0 <= p.initial_scale_power <= 63 or p.loss_scale_window < 1 or p.hysteresis < 1:
        out.append("precision.initial_scale_power must be in [0, 63], loss_scale_window and hysteresis >= 1.")
    return out


def _model_data_problems(cfg: TrainConfig) -> list[str]:
    m, d, out = cfg.model, cfg.data, []
    if isinstance(m, GPTModelSchema):
        from lightning_zero.models.gpt_config import GPT_PRESETS

        if not isinstance(d, TextDataSchema):
            out.append(f"model.kind=gpt needs text data, got data.kind={d.kind}. Fix: data=stdlib, data=text_file "
                       "or data=synthetic.")
        if m.preset not in GPT_PRESETS:
            return out + [f"model.preset={m.preset!r} is not a GPT preset; choose from {', '.join(GPT_PRESETS)}."]
        shape = gpt_config(m)
        if shape.n_embd % shape.n_head:
            out.append(f"model n_embd={shape.n_embd} is not divisible by n_head={shape.n_head}.")
        if isinstance(d, TextDataSchema) and d.seq_len > shape.seq_len:
            out.append(f"data.seq_len={d.seq_len} exceeds the model's context {shape.seq_len} ({m.preset}). "
                       f"Fix: data.seq_len={shape.seq_len} or less, or model.seq_len={d.seq_len}.")
    if isinstance(m, HFCausalLMSchema):
        out += _hf_problems(cfg)
    elif isinstance(d, TextDataSchema) and d.tokenizer:
        out.append(f"data.tokenizer={d.tokenizer} with model.kind={getattr(m, 'kind', m)}: the package's GPT reads "
                   "bytes (vocabulary 256). Fix: data.tokenizer=null, or model=hf_causal_lm.")
    if isinstance(m, ModelSchema) and m.optimizer is OptimizerName.onebit_adam:
        if not isinstance(m, GPTModelSchema):
            out.append(f"model.optimizer=onebit_adam is built by the GPT experiment, not model.kind={m.kind}. "
                       "Fix: model.optimizer=adamw.")
        elif ZeroStage.of(cfg.zero.stage).shards_optimizer:
            out.append(f"model.optimizer=onebit_adam runs with ZeRO stage 0 (it compresses the all-reduce of every "
                       f"rank's whole momentum), got zero.stage={cfg.zero.stage}. Fix: zero=stage0.")
        elif m.freeze_step < 1:
            out.append(f"model.freeze_step must be >= 1 (AdamW warm-up steps), got {m.freeze_step}.")
    if isinstance(m, MLPModelSchema):
        if not isinstance(d, TeacherDataSchema):
            out.append(f"model.kind=mlp needs classification data, got data.kind={d.kind}. Fix: data=teacher.")
        elif (m.input_dim, m.num_classes) != (d.input_dim, d.num_classes):
            out.append(f"model.input_dim/num_classes ({m.input_dim}/{m.num_classes}) differ from data.input_dim/"
                       f"num_classes ({d.input_dim}/{d.num_classes}). Fix: set both to the same values.")
    if isinstance(d, TextDataSchema) and d.path and not d.synthetic and not Path(d.path).expanduser().exists():
        out.append(f"data.path={d.path} does not exist (relative paths are taken from the current directory, "
                   f"{Path.cwd()}). Fix: data.path=/path/to/corpus.txt.")
    if isinstance(d, TextDataSchema) and not 0.0 < d.val_fraction < 1.0:
        out.append(f"data.val_fraction must be in (0, 1) for a held-out validation split, got {d.val_fraction}.")
    out += resume_problems(cfg)
    try:  # multi-node: this node's rank and node 0's endpoint (config or environment)
        resolve_node(cfg.trainer.num_nodes, cfg.trainer.node_rank, cfg.trainer.rdzv_endpoint)
    except ValueError as err:
        out.append(str(err))
    return out


def _hf_problems(cfg: TrainConfig) -> list[str]:
    m, d = cfg.model, cfg.data
    text = isinstance(d, TextDataSchema)
    if not text and not isinstance(d, TargetNode):
        return [f"model=hf_causal_lm needs text data, got data.kind={d.kind}. Fix: data=text_file data.path=... "
                "(tokenized with the model's tokenizer), or your own data module."]
    run = HFRun(path=m.path, config=m.config, tokenizer=(d.tokenizer if text else None) or m.tokenizer,
                text_data=text, seq_len=d.seq_len if text else None,
                shards_parameters=ZeroStage.of(cfg.zero.stage).shards_parameters if cfg.zero.stage in BUILT_STAGES
                else False, tensor=cfg.tensor_parallel.size, sequence=cfg.sequence_parallel.size,
                pipeline=cfg.pipeline.stages, sparse=m.attention != "dense" or bool(m.sparse_attention))
    return hf_problems(run)


def _range(out: list[str], key: str, value: float | None, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = True, fix: str = "") -> None:
    """Append ``key=value must be ...`` to ``out`` when ``value`` (unless ``None``) is outside the range."""
    if value is None:
        return
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        want = f"in {lo}, {hi}" if low is not None and high is not None else \
            (f"> {low:g}" if low_open else f">= {low:g}") if high is None else f"< {high:g}"
        out.append(f"{key}={value:g} must be {want}." + (f" {fix}" if fix else ""))


def counts(value: object) -> bool:
    """Whether a ``trainer.limit_*_batches`` / ``val_check_interval`` value counts (batches, optimizer steps) rather
    than being a share: an int, or a whole float above 1, as Lightning reads them (Note [counts and shares] in
    config/schema.py)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value > 1 and value.is_integer())


def val_check_batches(cfg: TrainConfig) -> float | None:
    """``trainer.val_check_interval`` as Lightning counts it: the config's whole number (> 1) counts optimizer
    steps, Lightning's counts training batches, so it is multiplied by the accumulation (a fraction <= 1 of
    an epoch is passed as it is)."""
    t = cfg.trainer
    value = t.val_check_interval
    if value is None or not counts(value):
        return value
    return int(value) * t.accumulate_grad_batches


def epoch_problems(cfg: TrainConfig) -> list[str]:
    """A text corpus too small for the run, known from its files' sizes (``model_zoo.epoch_batches``): no training
    batch at all, or fewer per epoch than ``trainer.val_check_interval`` (which Lightning refuses once the ranks
    have started)."""
    replicas, t, d = data_parallel_size(cfg), cfg.trainer, cfg.data
    counted = epoch_batches(cfg, replicas)
    if counted is None or not isinstance(d, TextDataSchema):
        return []
    size, samples, batches = counted
    limit = t.limit_train_batches
    if limit is not None:
        batches = min(batches, int(limit)) if counts(limit) else int(batches * limit)
    where = "data.synthetic=true" if d.synthetic else f"data.path={d.path}" if d.path else "the standard library"
    size_text = (f"{where} holds {size:,} bytes: {samples} training samples of data.seq_len={d.seq_len} (the last "
                 f"{d.val_fraction:.0%} held out), {batches} batch(es) of data.micro_batch_size={d.micro_batch_size} "
                 f"per epoch on each of {replicas} data-parallel rank(s)")
    if batches < 1:
        return [f"{size_text}: no training batch. Fix: more data, or a smaller data.seq_len / data.micro_batch_size."]
    interval = val_check_batches(cfg)
    if isinstance(interval, int) and interval > batches and t.check_val_every_n_epoch is not None:
        return [f"trainer.val_check_interval={t.val_check_interval} steps is more than one epoch: {size_text}. "
                f"Fix: trainer.val_check_interval={batches // t.accumulate_grad_batches} or less, "
                f"trainer.check_val_every_n_epoch=null (validation every {t.val_check_interval} steps across "
                "epochs), or more data."]
    return []


def _count_or_share(out: list[str], key: str, value: object, positive: bool) -> None:
    """A count (:func:`counts`) >= 0, or a share in [0, 1]; ``positive``: > 0 either way."""
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        share = isinstance(value, float) and not counts(value)
        if (value > 0 if positive else value >= 0) and (not share or value <= 1):
            return
    low = "(0" if positive else "[0"
    out.append(f"trainer.{key}={value!r} must be a whole number (a count: trainer.{key}=1 is one) or a fraction in "
               f"{low}, 1] (a share: 1.0 is all).")


def _value_problems(cfg: TrainConfig) -> list[str]:
    """Single values out of their range: optimizer, schedule, batch, trainer cadence (one line each)."""
    m, d, t, out = cfg.model, cfg.data, cfg.trainer, []
    if isinstance(m, ModelSchema):
        _range(out, "model.lr", m.lr, 0, None, low_open=True, fix="Fix: a positive learning rate, e.g. model.lr=3e-4.")
        _range(out, "model.weight_decay", m.weight_decay, 0, None)
    if isinstance(m, GPTModelSchema):
        if len(m.betas) != 2:
            out.append(f"model.betas={list(m.betas)} must be two numbers, e.g. model.betas=[0.9,0.95].")
        for i, beta in enumerate(m.betas[:2]):
            _range(out, f"model.betas[{i}]", beta, 0, 1)
        _range(out, "model.warmup_steps", m.warmup_steps, 0, None)
        _range(out, "model.lr_decay_steps", m.lr_decay_steps, 0, None, low_open=True)
        _range(out, "model.min_lr_ratio", m.min_lr_ratio, 0, 1, high_open=False)
        _range(out, "model.dropout", m.dropout, 0, 1)
        for key in ("seq_len", "n_layer", "n_head", "n_embd"):
            _range(out, f"model.{key}", getattr(m, key), 1, None)
    elif isinstance(m, MLPModelSchema):
        for key in ("input_dim", "hidden_dim", "num_layers", "num_classes"):
            _range(out, f"model.{key}", getattr(m, key), 1, None)
    if isinstance(d, DataSchema):
        _range(out, "data.micro_batch_size", d.micro_batch_size, 1, None)
        _range(out, "data.num_workers", d.num_workers, 0, None)
    if isinstance(d, TextDataSchema):
        _range(out, "data.seq_len", d.seq_len, 1, None)
        _range(out, "data.max_bytes", d.max_bytes, 1, None)
        _range(out, "data.max_val_samples", d.max_val_samples, 1, None)
    _range(out, "trainer.devices", t.devices, 1, None)
    if t.max_steps < -1 or t.max_steps == 0:
        out.append(f"trainer.max_steps={t.max_steps} must be >= 1, or -1 (no step limit).")
    _range(out, "trainer.max_epochs", t.max_epochs, 1, None)
    _count_or_share(out, "val_check_interval", t.val_check_interval, positive=True)
    _range(out, "trainer.check_val_every_n_epoch", t.check_val_every_n_epoch, 1, None)
    _range(out, "trainer.accumulate_grad_batches", t.accumulate_grad_batches, 1, None)
    _range(out, "trainer.gradient_clip_val", t.gradient_clip_val, 0, None)
    _range(out, "trainer.log_every_n_steps", t.log_every_n_steps, 1, None)
    _range(out, "trainer.num_sanity_val_steps", t.num_sanity_val_steps, -1, None)
    for key in ("limit_train_batches", "limit_val_batches"):
        _count_or_share(out, key, getattr(t, key), positive=False)
    if t.max_time is not None and not re.fullmatch(r"\d+:\d\d:\d\d:\d\d", t.max_time):
        out.append(f"trainer.max_time={t.max_time} must be DD:HH:MM:SS, e.g. trainer.max_time=00:01:30:00.")
    _range(out, "trainer.checkpoint.every_n_train_steps", t.checkpoint.every_n_train_steps, 1, None)
    _range(out, "trainer.checkpoint.save_top_k", t.checkpoint.save_top_k, -1, None)
    _range(out, "zero.timeout_s", cfg.zero.timeout_s, 0, None, low_open=True)
    return out


def import_object(path: str) -> Any:
    """The object at ``"package.module:Name"`` (or ``"package.module.Name"``)."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ValueError(f"expected 'module.path:Name', got {path!r}")
    return getattr(importlib.import_module(module), name)


def invalid_combinations(cfg: TrainConfig) -> list[str]:
    """Every reason ``cfg`` cannot work, each with its fix (empty when it is valid)."""
    problems: list[str] = []
    if isinstance(cfg.model, GPTModelSchema):
        from lightning_zero.sparse_attention import resolve_attention

        try:
            section = resolve_attention(cfg.model.attention, cfg.model.sparse_attention)
        except (ValueError, NotImplementedError) as err:
            problems.append(f"model.attention / model.sparse_attention: {err}")
        else:
            if section is not None and preset_known(cfg.model) and gpt_config(cfg.model).dropout:
                problems.append("sparse attention has no attention dropout: set model.dropout=0")
            try:
                dense_layout_warning(cfg)
            except ValueError as err:  # the pattern's own check, which the first forward would make on every rank
                problems.append(f"model.attention={cfg.model.attention} at data.seq_len={cfg.data.seq_len}: {err}.")
    try:
        zero_config(cfg)
    except ValueError as err:
        if cfg.zero.stage not in BUILT_STAGES:  # the root problem: every stage-dependent check would follow from it
            return [f"zero.stage={cfg.zero.stage}: {err} Fix: zero=stage0, stage1, stage2 or stage3."]
        problems.append(f"zero: {err}")
    for key in ("elementwise_optimizers", "unit_classes"):
        for path in getattr(cfg.zero, key):
            try:
                import_object(path)
            except (ImportError, AttributeError, ValueError) as err:
                problems.append(f"zero.{key}: cannot import {path!r} ({err}).")
    for node in user_nodes(cfg.model, cfg.data, cfg.logger, cfg.callbacks):  # as far as their source says
        problems += static_problems(node)
    problems += tensor_parallel_problems(cfg)
    problems += node_device_problems(str(cfg.trainer.accelerator), cfg.trainer.devices)
    for check in (_value_problems, _offload_problems, _precision_problems, pipeline_problems,
                  _model_data_problems, sequence_problems, expert_parallel_problems):
        problems += check(cfg)
    if not problems:  # sizes of a config that is otherwise valid (a corpus that exists, sizes >= 1)
        problems += epoch_problems(cfg)
    return problems


def config_warnings(cfg: TrainConfig) -> list[str]:
    """Valid settings that will not do what they are for (printed once, before launch)."""
    out = []
    m, max_steps = cfg.model, cfg.trainer.max_steps
    onebit = isinstance(m, ModelSchema) and m.optimizer is OptimizerName.onebit_adam
    if onebit and max_steps is not None and 0 < max_steps <= m.freeze_step:
        out.append(f"model.freeze_step={m.freeze_step} >= trainer.max_steps={max_steps}: 1-bit Adam stays in its "
                   "AdamW warm-up for the whole run and never compresses. Fix: model.freeze_step="
                   f"{max(1, max_steps // 2)} (or more steps).")
    dense = dense_layout_warning(cfg)
    return [*out, dense] if dense else out


def unbuilt_features(cfg: TrainConfig) -> list[str]:
    """The features ``cfg`` asks for that lightning_zero does not implement yet (empty when all are built)."""
    out = []
    if cfg.zero.stage not in BUILT_STAGES:
        out.append(f"ZeRO stage {cfg.zero.stage} (zero=stage{cfg.zero.stage}, partitioned parameters); "
                   "use zero=stage0, stage1 or stage2")
    return out


def validate_config(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """Check a composed config across groups; return it typed.

    Raises:
        ValueError: a mandatory value is missing, or the combination is invalid (every reason and fix).
        NotImplementedError: the combination is valid but needs a feature not built yet (named).
    """
    if isinstance(cfg, DictConfig):
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ValueError(f"missing mandatory value(s): {', '.join(missing)}. Set them on the command line, "
                             f"e.g. {missing[0]}=...")
        cfg = to_train_config(cfg)
    problems = invalid_combinations(cfg)
    if problems:
        raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))
    todo = unbuilt_features(cfg)
    if todo:
        raise NotImplementedError("not implemented in lightning_zero yet: " + "; ".join(todo) + ".")
    return cfg


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


# the value of each of run_choices' dimensions when it is off: the header line names the others
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
