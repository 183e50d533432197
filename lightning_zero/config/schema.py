"""Typed schemas of the Hydra config groups in ``conf/``, registered in Hydra's ConfigStore by ``paths.py``.

Every YAML option of a group starts with ``defaults: [<group schema>, _self_]``, so a misspelt key
or a value of the wrong type fails when Hydra composes the config, naming the key. The root schema
:class:`TrainConfig` types each group too. The knob names follow DeepSpeed's JSON config where
DeepSpeed has one (``reduce_bucket_size``, ``loss_scale_window``, ``offload_optimizer.device``, ...).

The settings tree's groups (``zero/``, ``offload/``, ``precision/``, ``pipeline/``, the parallel sizes) are
``settings_schema.py``'s, mirrors of their core nodes; here are the run's other groups (model, data, trainer,
checkpoint, logger, profiler) and the root. Where a module already declares the knobs (the profiler window, the
teacher task), the schema is built from it (``settings_schema.mirror``) instead of restating them.

Rules across groups are not expressible as types: the settings tree's are ``core/settings/rules.py``'s, the
others' :func:`lightning_zero.config.validate.validate_config`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_zero.config.settings_schema import (
    ExpertParallelSchema,
    OffloadSchema,
    PipelineSchema,
    PrecisionSchema,
    SequenceParallelSchema,
    TensorParallelSchema,
    ZeroSchema,
    mirror,
)
from lightning_zero.models.mlp_parts import TeacherTask
from lightning_zero.observability.monitoring import ProfilerWindow
from lightning_zero.project.targets import USER_KEYS, as_plain, user_parts


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
    # torch's fused kernel for adamw / adam / sgd (disk offload steps fused anyway: set it to compare bitwise)
    fused: bool = False
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


TeacherDataSchema = mirror(
    "TeacherDataSchema",
    """``experiments.mlp.TeacherDataModule``: a synthetic random-teacher classification task (the
    arguments of :class:`~lightning_zero.models.mlp.TeacherDataModule`: the fields of
    :class:`~lightning_zero.models.mlp_parts.TeacherTask`).""",
    ("kind", str, "teacher"),
    TeacherTask,
    base=DataSchema,
    module=__name__,
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


ProfilerSchema = mirror(
    "ProfilerSchema",
    """``profiler.*`` (a root key, no group): ``torch.profiler`` with memory profiling over a window of
    optimizer steps, traces in ``<run dir>/<logger.name>/profiler``: ``enabled`` and the fields of
    :class:`lightning_zero.ProfilerWindow`.""",
    ("enabled", bool, False),
    ProfilerWindow,
    module=__name__,
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
