"""Where the Hydra configs live: the ``conf/`` directory, the root config's name, and the typed schemas
(``schema.py``) as Hydra's ConfigStore entries that the YAML options name in their defaults; and where a run goes:
its directory's name (the ``lz_run_name`` resolver) and the result its rank 0 writes there (:class:`FitResult` in
``result.json``). The launcher reads these without importing Lightning (``build.py``, which does, writes them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lightning_zero.config.schema import (
    ExpertParallelSchema,
    GPTModelSchema,
    HFCausalLMSchema,
    LoggerSchema,
    MLPModelSchema,
    OffloadSchema,
    PipelineSchema,
    PrecisionSchema,
    SequenceParallelSchema,
    TeacherDataSchema,
    TensorParallelSchema,
    TextDataSchema,
    TrainConfig,
    TrainerSchema,
    ZeroSchema,
)

CONFIG_NAME = "config"
CONF_ENV = "LIGHTNING_ZERO_CONF"


def conf_dir() -> Path:
    """The ``conf/`` directory: ``$LIGHTNING_ZERO_CONF`` if set, else the one beside the package."""
    path = Path(os.environ.get(CONF_ENV) or Path(__file__).resolve().parents[2] / "conf")
    if not (path / f"{CONFIG_NAME}.yaml").is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME}.yaml in {path}; set {CONF_ENV} to the conf/ directory")
    return path


# (group, name) -> schema; a YAML option lists its group's schema name first in its defaults.
SCHEMAS: dict[tuple[str | None, str], type[Any]] = {
    (None, "train_schema"): TrainConfig,
    ("zero", "zero_schema"): ZeroSchema,
    ("offload", "offload_schema"): OffloadSchema,
    ("precision", "precision_schema"): PrecisionSchema,
    ("pipeline", "pipeline_schema"): PipelineSchema,
    ("tensor_parallel", "tensor_parallel_schema"): TensorParallelSchema,
    ("sequence_parallel", "sequence_parallel_schema"): SequenceParallelSchema,
    ("expert_parallel", "expert_parallel_schema"): ExpertParallelSchema,
    ("model", "gpt_schema"): GPTModelSchema,
    ("model", "mlp_schema"): MLPModelSchema,
    ("model", "hf_causal_lm_schema"): HFCausalLMSchema,
    ("data", "text_schema"): TextDataSchema,
    ("data", "teacher_schema"): TeacherDataSchema,
    ("trainer", "trainer_schema"): TrainerSchema,
    ("logger", "logger_schema"): LoggerSchema,
}


def group_options(group: str) -> list[str]:
    """The options of a config group: its YAML files under ``conf/`` (the typed ``*_schema`` entries of
    Hydra's ConfigStore are not options)."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def config_groups_text() -> str:
    """``group: option, option, ...`` for every group of ``conf/``, as Hydra's ``--help`` lists them but without
    the schemas (which Hydra would list as options: they are refused when chosen)."""
    groups = sorted(p.name for p in conf_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml")))
    return "\n".join(f"{group}: {', '.join(group_options(group))}" for group in groups)


HELP_GROUPS_RESOLVER = "lz_config_groups"  # conf/config.yaml's hydra.help.template uses it


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent; call before composing ``conf/``)."""
    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)


RUN_NAME_RESOLVER = "lz_run_name"  # conf/config.yaml's hydra.run.dir and hydra.sweep.subdir use it


def run_name(name: str, zero_stage: Any, precision: Any, offload: str = "none", pipeline: str = "none",
             optimizer: Any = "adamw", deepspeed_config: str | None = None, tensor: Any = 1, sequence: Any = 1,
             attention: Any = "dense", expert: Any = 1) -> str:
    """A run's directory name from its choices, as TensorBoard lists the run, e.g. ``gpt_tiny-zero3-bf16``;
    what is not the default is added: the offload and pipeline choices, tensor, sequence and expert parallel
    (``-tp2``, ``-sp2``, ``-ep2``), the attention (``-sparse_fixed``), an optimizer other than ``adamw``
    (``gpt_tiny-zero0-fp32-onebit_adam``). With a DeepSpeed JSON, which sets those after Hydra named the
    directory, the JSON file's name stands for them (``gpt_tiny-ds_config``)."""
    def text(value: Any) -> str:
        return str(getattr(value, "value", value))

    if deepspeed_config:
        return f"{text(name)}-{Path(str(deepspeed_config)).stem}"
    parts = [text(name), f"zero{text(zero_stage)}", text(precision)]
    parts += [text(v) for v in (offload, pipeline) if text(v) != "none"]
    parts += [f"{short}{size}" for short, size in (("tp", tensor), ("sp", sequence), ("ep", expert)) if int(size) > 1]
    for value, default in ((attention, "dense"), (optimizer, "adamw")):
        if isinstance(getattr(value, "value", value), str) and text(value) != default:  # not a `_target_` node
            parts.append(text(value))
    return "-".join(parts)


def register_run_name() -> None:
    """Register :func:`run_name` as the OmegaConf resolver ``lz_run_name``, and :func:`config_groups_text` as
    ``lz_config_groups`` (``--help``'s groups) (idempotent; before Hydra composes)."""
    if not OmegaConf.has_resolver(RUN_NAME_RESOLVER):
        OmegaConf.register_new_resolver(RUN_NAME_RESOLVER, run_name)
    if not OmegaConf.has_resolver(HELP_GROUPS_RESOLVER):
        OmegaConf.register_new_resolver(HELP_GROUPS_RESOLVER, config_groups_text)


RESULT_FILE = "result.json"


@dataclass
class FitResult:
    """What one run did (rank 0 writes it to ``run_dir/result.json``)."""

    global_step: int
    seconds: float
    val_loss_start: float | None
    val_loss_end: float | None
    checkpoints: list[str]
    resumed_at: int = 0  # the global step the fit resumed from (0: a fresh run)
    # the layout that ran, read from the strategy's mesh: world_size, data, pipeline, tensor, sequence, and the
    # modules the tensor-parallel plan split (0: none)
    layout: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: steps (those of this run when resumed), fit time, validation loss at start and end."""

        def fmt(x: float | None) -> str:
            return "-" if x is None else f"{x:.4f}"

        drop = ("" if self.val_loss_start is None or self.val_loss_end is None
                else f" (drop {self.val_loss_start - self.val_loss_end:.3f} nats)")
        steps = (f"steps={self.global_step} ({self.global_step - self.resumed_at} in this run, resumed at step "
                 f"{self.resumed_at})" if self.resumed_at else f"steps={self.global_step}")
        return (f"{steps} fit_time={self.seconds:.1f}s val_loss {fmt(self.val_loss_start)} -> "
                f"{fmt(self.val_loss_end)}{drop}")


FIT = "fit"  # the Trainer's methods a command runs: `train` fits, the others are named as they are
COMMAND_NAMES = {FIT: "train", "validate": "validate", "test": "test", "predict": "predict"}
LAST_CHECKPOINT = ("checkpoints", "last.ckpt")  # where a run directory keeps its last checkpoint


def checkpoint_of(path: str | os.PathLike[str]) -> Path:
    """The checkpoint ``ckpt_path`` names: a checkpoint file or sharded directory, or a finished run's directory
    (its ``checkpoints/last.ckpt``, a link followed).

    Raises:
        FileNotFoundError: neither (the message says what was looked for).
    """
    path = Path(path).expanduser()
    last = path.joinpath(*LAST_CHECKPOINT)
    if (path / RESULT_FILE).is_file() or last.exists():  # a run directory
        if not last.exists():
            raise FileNotFoundError(f"ckpt_path={path} is a run directory without {'/'.join(LAST_CHECKPOINT)} "
                                    "(trainer.checkpoint.enabled was off?). Fix: a checkpoint file or directory.")
        return last.resolve()
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={path} does not exist (relative paths are taken from {Path.cwd()}). "
                                "Fix: a checkpoint, or a finished run's directory.")
    return path


@dataclass
class EvalResult:
    """What ``lightning-zero validate / test / predict`` did (rank 0 writes it to ``run_dir/result.json``)."""

    command: str
    checkpoint: str | None
    metrics: dict[str, float] = field(default_factory=dict)  # validate / test: the logged metrics
    predictions: list[str] = field(default_factory=list)  # predict: each rank's file under run_dir

    def summary(self) -> str:
        """One line: the command, its checkpoint and its metrics (or prediction files)."""
        what = ", ".join(f"{k} {v:.4f}" for k, v in sorted(self.metrics.items())) or \
            (f"{len(self.predictions)} prediction file(s)" if self.predictions else "no metrics")
        return f"{self.command} of {self.checkpoint or 'the initial weights'}: {what}"
