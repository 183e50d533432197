"""Typed schemas of the Hydra config groups in ``conf/``, registered in Hydra's ConfigStore by ``paths.py``.

Every YAML option of a group starts with ``defaults: [<group schema>, _self_]``, so a misspelt key
or a value of the wrong type fails when Hydra composes the config, naming the key. The root schema
:class:`TrainConfig` types each group too. The knob names follow DeepSpeed's JSON config where
DeepSpeed has one (``reduce_bucket_size``, ``loss_scale_window``, ``offload_optimizer.device``, ...).

Where a core dataclass or a module already declares the knobs (the fp16 loss scaler, the profiler
window, the teacher task), the schema is built from it (``_mirror``) instead of restating
them, and option lists kept elsewhere become enums the same way (``_choices``).

Cross-group rules (e.g. parameter offload needs stage 3) are not expressible as types; they live in
:func:`lightning_zero.config.validate.validate_config`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass, replace
from enum import Enum
from typing import Any, get_type_hints

from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_zero.core.common.choices import Collective as CoreCollective
from lightning_zero.core.common.choices import PipeSchedule as CorePipeSchedule
from lightning_zero.core.settings import offload as core_offload
from lightning_zero.core.settings import zero as core_zero
from lightning_zero.core.settings.precision import LossScalerConfig
from lightning_zero.models.mlp_parts import TeacherTask
from lightning_zero.observability.monitoring import ProfilerWindow
from lightning_zero.project.targets import USER_KEYS, as_plain, user_parts


def _choices(name: str, values: Iterable[str], doc: str) -> Any:
    """An ``Enum`` of the options ``values`` (each member named as its value), for options whose list
    lives elsewhere."""
    choices = Enum(name, [(v, v) for v in values])  # type: ignore[misc]
    choices.__module__, choices.__doc__ = __name__, doc
    return choices


def _fields_of(source: type) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of a dataclass's fields, or of the parameters of a class's ``__init__``."""
    if is_dataclass(source):
        hints = get_type_hints(source)
        return [(f.name, hints[f.name], f.default) for f in fields(source)]
    hints = get_type_hints(source.__init__)
    return [(p.name, hints[p.name], p.default) for p in inspect.signature(source).parameters.values()]


def _mirror(name: str, doc: str, *parts: tuple[str, Any, Any] | type, base: type | None = None) -> Any:
    """A schema dataclass (subclassing ``base``) whose fields are ``parts`` in order: a ``(name, type,
    default)`` field, or a frozen core dataclass or a class whose fields / ``__init__`` parameters are
    taken over with their types and defaults, so that a knob and its default are written once, next
    to the mechanism. (The schema itself is mutable: Hydra merges overrides into it.)"""
    specs = [(n, t, field(default_factory=lambda d=d: list(d)) if isinstance(d, list) else field(default=d))
             for part in parts for n, t, d in ([part] if isinstance(part, tuple) else _fields_of(part))]
    schema = make_dataclass(name, specs, bases=(base,) if base else (), namespace={"__doc__": doc})
    schema.__module__ = __name__
    return schema


Collective = _choices("Collective", [c.value for c in CoreCollective],
                      "Gradient / parameter collectives of the ZeRO engine (``ZeroConfig.collective``).")


def _in_yaml(source: type, types: dict[str, Any], leave_out: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of a core dataclass's fields in the types YAML writes them in (``types``: a
    field's YAML type; its default converted to it: an enum's value, a tuple of classes as a list of import
    paths), so that the default stays written once, in the core."""
    out = []
    for name, hint, default in _fields_of(source):
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
PrecisionName = _choices("PrecisionName", LIGHTNING_PRECISION,
                         "Precision modes: the keys of :data:`LIGHTNING_PRECISION`.")


PipeSchedule = _choices("PipeSchedule", ["none", *(s.name.lower() for s in CorePipeSchedule)],
                        "Pipeline schedules: ``none`` (no pipeline) and the core's ``PipeSchedule`` by name "
                        "(``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``).")


class OptimizerName(Enum):
    """Optimizers the experiment modules build."""

    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"
    onebit_adam = "onebit_adam"  # 1-bit Adam (lightning_zero.OneBitAdam): ZeRO stage 0, GPT only


class LRSchedule(Enum):
    """Learning-rate schedule after warmup."""

    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class LoggerKind(Enum):
    """Experiment logger written into the run's output directory."""

    tensorboard = "tensorboard"
    csv = "csv"
    none = "none"


ZeroSchema = _mirror(
    "ZeroSchema",
    """``zero/``: the ZeRO stage and its knobs, the fields of :class:`~lightning_zero.ZeroConfig` (each default written
    once, there) in YAML's types: the stage an int, ``collective`` the :class:`Collective` options, ``nonfinite`` a
    string (``raise`` cannot be an enum member name, which OmegaConf parses by; ``ZeroConfig`` checks it),
    ``elementwise_optimizers`` / ``unit_classes`` as ``"module.path:ClassName"`` import paths; and the strategy's
    ``check_step_errors`` and ``gather_on_teardown`` (the CLI needs nothing back after fit, as validate_at_end runs
    inside it, so by default it does not gather; docs/zero.md). ``activation_checkpointing`` is the model's choice,
    not a ``zero/`` option.""",
    *_in_yaml(core_zero.ZeroConfig, {"stage": int, "collective": Collective, "nonfinite": str,
                                     "elementwise_optimizers": list[str], "unit_classes": list[str]},
              leave_out=("activation_checkpointing",)),
    ("check_step_errors", bool, True),
    ("gather_on_teardown", bool, False),
)


OffloadSchema = _mirror(
    "OffloadSchema",
    """``offload/``: ZeRO-Offload / ZeRO-Infinity (DeepSpeed's ``offload_optimizer`` / ``offload_param``), the fields
    of :class:`~lightning_zero.OffloadConfig` (each default written once, there); ``pin_memory`` may be ``null``:
    pinned where ``trainer.accelerator`` is not cpu and CUDA is there (the cpu presets), so CPU runs do not warn
    on every rank (DeepSpeed's default is false; true needs an accelerator, else a warning).""",
    *_in_yaml(core_offload.OffloadConfig, {"pin_memory": bool | None}),
)


PrecisionSchema = _mirror(
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
class GPTMoESchema:
    """``model.moe``: the GPT's mixture-of-experts option (``lightning_zero.models.gpt_config.GPTMoE``;
    ``num_experts=0``: dense MLPs)."""

    num_experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    eval_capacity_factor: float | None = None
    min_capacity: int = 0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    intermediate_size: int | None = None  # None: 4 x n_embd


@dataclass
class SequenceParallelSchema:
    """``sequence_parallel/``: ranks per sequence group (DeepSpeed-Ulysses, docs/sequence_parallel.md; 1: off)."""

    size: int = 1


@dataclass
class ModelSchema:
    """``model/``: common fields; ``kind`` picks the builder (``gpt`` or ``mlp``)."""

    kind: str = MISSING
    lr: float = 1e-3
    weight_decay: float = 0.0
    optimizer: OptimizerName = OptimizerName.adamw


@dataclass
class GPTModelSchema(ModelSchema):
    """A GPT preset of ``experiments.gpt.GPT_PRESETS``; ``None`` shape fields keep the preset's value."""

    kind: str = "gpt"
    preset: str = "gpt_small"
    seq_len: int | None = None
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    dropout: float | None = None
    tie_weights: bool | None = None  # None: the preset's (tied token embedding and head)
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    scheduler: LRSchedule = LRSchedule.constant
    lr_decay_steps: int | None = None
    min_lr_ratio: float = 0.1
    build_in_configure_model: bool = False
    freeze_step: int = 100  # optimizer=onebit_adam: AdamW warm-up steps before the momentum is compressed
    # dense (SDPA) or a block-sparse preset: sparse_fixed, sparse_variable, sparse_bigbird, sparse_bslongformer,
    # sparse_local, sparse_dense (docs/sparse_attention.md)
    attention: str = "dense"
    # DeepSpeed `sparse_attention` keys over the preset's (a DeepSpeed JSON's section lands here)
    sparse_attention: dict[str, Any] | None = None
    moe: GPTMoESchema = field(default_factory=GPTMoESchema)  # model.moe.num_experts=8: MoE MLPs


@dataclass
class MLPModelSchema(ModelSchema):
    """``experiments.mlp.MLPClassifier``."""

    kind: str = "mlp"
    input_dim: int = 32
    hidden_dim: int = 128
    num_layers: int = 2
    num_classes: int = 10
    lr: float = 1e-2


@dataclass
class HFCausalLMSchema(ModelSchema):
    """``model=hf_causal_lm``: any ``transformers`` ``AutoModelForCausalLM`` (``lightning_zero.hf.HFCausalLM``), from a
    local directory ``save_pretrained`` wrote (``path``: config, safetensors, possibly sharded with an index, and a
    tokenizer), or built from ``config`` with random weights (a ``config.json`` or a directory holding one, or a
    mapping with ``model_type`` and the config's keys). At ZeRO stage 3 it is built on the meta device and each
    tensor is streamed from the files into its owner's shard (docs/your_own_model.md)."""

    kind: str = "hf_causal_lm"
    path: str | None = None
    config: Any = None
    tokenizer: str | None = None  # null: the one in `path` (data=text_file tokenizes with it)
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    attn_implementation: str = "sdpa"  # transformers' attention (sdpa, eager); model.attention=sparse_* replaces it
    attention: str = "dense"  # dense, or a block-sparse preset (docs/sparse_attention.md): the model's attention
    sparse_attention: dict[str, Any] | None = None


@dataclass
class DataSchema:
    """``data/``: common fields; ``kind`` picks the data module (``text`` or ``teacher``)."""

    kind: str = MISSING
    micro_batch_size: int = 8
    num_workers: int = 0
    seed: int = 0
    deterministic_order: bool = False


@dataclass
class TextDataSchema(DataSchema):
    """``experiments.data.TextDataModule``: stdlib source (``path: null``), a text file/dir, or synthetic."""

    kind: str = "text"
    path: str | None = MISSING  # null: the Python standard library (an option must say which)
    seq_len: int = 128
    max_bytes: int | None = 8_000_000
    pattern: str | None = None
    val_fraction: float = 0.05
    max_val_samples: int | None = 128
    synthetic: bool = False
    tokenizer: str | None = None  # a transformers tokenizer directory; null: bytes (with model=hf_causal_lm: its own)


TeacherDataSchema = _mirror(
    "TeacherDataSchema",
    """``experiments.mlp.TeacherDataModule``: a synthetic random-teacher classification task (the
    arguments of :class:`~lightning_zero.models.mlp.TeacherDataModule`: the fields of
    :class:`~lightning_zero.models.mlp_parts.TeacherTask`).""",
    ("kind", str, "teacher"),
    TeacherTask,
    base=DataSchema,
)


@dataclass
class CheckpointSchema:
    """``trainer.checkpoint``: ``ModelCheckpoint(dirpath=<run dir>/checkpoints, ...)``."""

    enabled: bool = True
    save_last: bool = True
    save_top_k: int = 0  # 0: only last.ckpt; with a monitor (e.g. val_loss), the k best too
    monitor: str | None = None
    every_n_train_steps: int | None = None


@dataclass
class TrainerSchema:
    """``trainer/``: ``lightning.pytorch.Trainer`` arguments, the number of ranks and checkpointing."""

    accelerator: str = "cpu"
    devices: int = 2  # processes per node
    num_nodes: int = 1  # > 1: every node runs the same command (docs: README "Several nodes")
    node_rank: int | None = None  # this node's rank; null: NODE_RANK / GROUP_RANK / SLURM_NODEID
    rdzv_endpoint: str | None = None  # node 0's HOST:PORT; null: MASTER_ADDR / MASTER_PORT
    max_steps: int = -1
    max_epochs: int | None = None
    max_time: str | None = None  # "DD:HH:MM:SS"
    # Note [counts and shares]: an int counts (optimizer steps; batches), a float <= 1 is a share of an epoch / of the
    # batches, so `1` and `1.0` differ as in Lightning. Typed Any: OmegaConf has no int | float, and a float field
    # turned the command line's `trainer.limit_val_batches=1` into 1.0, every batch (config/validate.py checks them)
    val_check_interval: Any = None  # int: every N optimizer steps; float <= 1: a share of an epoch
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: Any = None  # int: batches per rank; float in [0, 1]: a share of them
    limit_val_batches: Any = None  # int: batches of all data-parallel replicas together; float in [0, 1]: a share
    num_sanity_val_steps: int = 0
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True  # Lightning's bar on a terminal, a line per log_every_n_steps otherwise
    enable_model_summary: bool = True
    deterministic: bool = False
    process_group_backend: str | None = None
    validate_at_start: bool = False  # one validation pass before fitting: the val loss at step 0
    validate_at_end: bool = False  # one validation pass after the last step
    resume_from: str | None = None  # a checkpoint (e.g. <run dir>/checkpoints/last.ckpt) to resume from
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)


@dataclass
class LoggerSchema:
    """``logger/``: where metrics go; always inside the run's output directory."""

    kind: LoggerKind = LoggerKind.tensorboard
    name: str = "tb"
    default_hp_metric: bool = False
    monitor: bool = True  # ZeroStrategy(monitor=...): the ZeroStatsMonitor dashboard (docs/monitoring.md)


ProfilerSchema = _mirror(
    "ProfilerSchema",
    """``profiler.*`` (a root key, no group): ``torch.profiler`` with memory profiling over a window of
    optimizer steps, traces in ``<run dir>/<logger.name>/profiler``: ``enabled`` and the fields of
    :class:`lightning_zero.ProfilerWindow`.""",
    ("enabled", bool, False),
    ProfilerWindow,
)


@dataclass
class TrainConfig:
    """The root schema of ``conf/config.yaml``: one field per config group, plus the run's name and seed.

    ``model``, ``data`` and ``logger`` hold a package option (typed by its schema, which the option's yaml names)
    or the user's ``_target_`` node (a :class:`~lightning_zero.project.targets.TargetNode`; several loggers: a
    mapping of names to them); ``callbacks`` maps names to ``_target_`` nodes (Note [user targets]).
    """

    zero: ZeroSchema = MISSING
    offload: OffloadSchema = MISSING
    precision: PrecisionSchema = MISSING
    pipeline: PipelineSchema = MISSING
    tensor_parallel: TensorParallelSchema = field(default_factory=TensorParallelSchema)
    model: Any = MISSING  # ModelSchema | TargetNode
    # a default, not MISSING: configs saved before the group existed still load
    sequence_parallel: SequenceParallelSchema = field(default_factory=SequenceParallelSchema)
    expert_parallel: ExpertParallelSchema = field(default_factory=ExpertParallelSchema)
    data: Any = MISSING  # DataSchema | TargetNode
    trainer: TrainerSchema = MISSING
    logger: Any = MISSING  # LoggerSchema | TargetNode | dict[str, TargetNode]
    callbacks: dict[str, Any] = field(default_factory=dict)  # name -> TargetNode (a `null` entry: off)
    name: str = "default"
    seed: int = 0
    deepspeed_config: str | None = None  # a DeepSpeed JSON over the groups (lightning_zero/config/run/deepspeed.py)
    deepspeed_strict: bool = False  # unsupported keys in that JSON are an error, not a warning
    profiler: ProfilerSchema = field(default_factory=ProfilerSchema)
    ckpt_path: str | None = None  # test / validate / predict: a checkpoint, or a finished run's directory


MODEL_SCHEMAS: dict[str, type[ModelSchema]] = {"gpt": GPTModelSchema, "mlp": MLPModelSchema,
                                                "hf_causal_lm": HFCausalLMSchema}
DATA_SCHEMAS: dict[str, type[DataSchema]] = {"text": TextDataSchema, "teacher": TeacherDataSchema}


def to_train_config(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """A typed :class:`TrainConfig` from a composed config or a plain mapping (e.g. a saved ``config.yaml``).

    Either is merged as plain data into fresh schemas (the model and data schemas picked by their
    ``kind``; a ``_target_`` node is the user's, kept as a :class:`TargetNode`), so keys added with
    ``+group.key=...`` are rejected too. Raises ``ValueError`` for an unknown kind and OmegaConf's errors
    (naming the key) for unknown keys or wrong types.
    """
    data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if isinstance(cfg, DictConfig) else cfg
    assert isinstance(data, dict)
    user = user_parts(data)
    node = OmegaConf.create({k: v for k, v in data.items() if k not in user})
    node.merge_with({k: {} if k == "callbacks" else None for k in user})  # set below, as typed objects
    base = OmegaConf.structured(TrainConfig)
    for key, table in (("model", MODEL_SCHEMAS), ("data", DATA_SCHEMAS)):
        if key in user:
            continue
        kind = OmegaConf.select(node, f"{key}.kind")
        if kind not in table:
            raise ValueError(f"{key}.kind must be one of {sorted(table)}, or {key} a node with a `_target_` (your "
                             f"own class), got kind {kind!r}")
        base[key] = OmegaConf.structured(table[kind])
    if "logger" not in user:
        base["logger"] = OmegaConf.structured(LoggerSchema)
    config = OmegaConf.to_object(OmegaConf.merge(base, node))
    assert isinstance(config, TrainConfig)
    for key, value in user.items():
        setattr(config, key, value)
    return config


def to_container(cfg: TrainConfig) -> DictConfig:
    """A typed config as an OmegaConf node (enums as enums), the user's ``_target_`` nodes as plain data."""
    user = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in (*USER_KEYS, "callbacks")}
    node = OmegaConf.structured(replace(cfg, **{k: None for k in USER_KEYS}, callbacks={}))
    for key, value in user.items():
        plain = as_plain(value)
        node[key] = plain if plain is not value else OmegaConf.structured(value)
    return node


def to_yaml(cfg: TrainConfig) -> str:
    """YAML text of a typed config (enums by name); :func:`to_train_config` reads it back."""
    return OmegaConf.to_yaml(to_container(cfg))
