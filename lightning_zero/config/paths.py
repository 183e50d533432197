"""Where the Hydra configs live: the ``conf/`` directory, the root config's name, and the typed schemas
(``schema.py``) as Hydra's ConfigStore entries that the YAML options name in their defaults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from lightning_zero.config.schema import (
    GPTModelSchema,
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
    ("model", "gpt_schema"): GPTModelSchema,
    ("model", "mlp_schema"): MLPModelSchema,
    ("data", "text_schema"): TextDataSchema,
    ("data", "teacher_schema"): TeacherDataSchema,
    ("trainer", "trainer_schema"): TrainerSchema,
    ("logger", "logger_schema"): LoggerSchema,
}


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent; call before composing ``conf/``)."""
    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
