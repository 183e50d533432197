"""From a validated :class:`~lightning_zero.config.schema.TrainConfig` to a finished Lightning fit.

Each ``build_*`` function converts one part (strategy, module, data, logger, callbacks, Trainer
arguments); :func:`fit` runs them in the current process, which is one rank: the launcher
(:mod:`lightning_zero.config.launch`) starts the ranks with ``torch.distributed.run``, so Lightning
finds its environment there and never re-launches ``sys.argv``. Everything a run writes goes into
``run_dir``: TensorBoard events under ``tb/``, checkpoints under ``checkpoints/``, ``result.json``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import OmegaConf

from lightning_zero.config.model_zoo import build_datamodule, build_module, param_init_fn
from lightning_zero.config.paths import RESULT_FILE, FitResult
from lightning_zero.config.schema import (
    GPTModelSchema,
    LoggerKind,
    TrainConfig,
    to_yaml,
)
from lightning_zero.config.settings import data_parallel_size, settings_of
from lightning_zero.deepspeed.strategy import DeepSpeedZeroStrategy
from lightning_zero.lightning.strategy import ZeroStrategy
from lightning_zero.observability.dashboard import ZeroTensorBoardLogger
from lightning_zero.observability.model_summary import ZeroModelSummary
from lightning_zero.observability.monitoring import ProfilerWindow, log_hyperparams
from lightning_zero.observability.progress import LineProgress


def strategy_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """Keyword arguments of :class:`~lightning_zero.ZeroStrategy` for ``cfg``: its settings tree
    (:func:`~lightning_zero.config.settings.settings_of`) and the strategy's other arguments."""
    return {
        "settings": settings_of(cfg),
        "check_step_errors": cfg.zero.check_step_errors,
        "process_group_backend": cfg.trainer.process_group_backend,
        "monitor": cfg.logger.monitor,
        "profiler": build_profiler(cfg),
        "param_init_fn": param_init_fn(cfg),
        "resolved_config": config_hparams(cfg),  # compared across ranks at setup (Note [setup agreement])
    }


def build_deepspeed_strategy(cfg: TrainConfig) -> ZeroStrategy:
    """The ranks' strategy for a merged, typed config with ``deepspeed_config``: the Hydra-side strategy
    arguments (equal to the JSON's wherever the JSON sets a value, after
    :func:`~lightning_zero.config.deepspeed.apply_deepspeed_config`) as overrides of
    ``DeepSpeedZeroStrategy.from_deepspeed_config``, whose optimizer / scheduler sections replace the model's."""
    return DeepSpeedZeroStrategy.from_deepspeed_config(cfg.deepspeed_config, strict=cfg.deepspeed_strict,
                                              optimizer_source="config", **strategy_arguments(cfg))


def build_profiler(cfg: TrainConfig) -> ProfilerWindow | None:
    """The monitor's profiler window of ``cfg.profiler`` (``None`` unless enabled)."""
    p = cfg.profiler
    if not p.enabled:
        return None
    return ProfilerWindow(**{f.name: getattr(p, f.name) for f in fields(ProfilerWindow)})


def config_hparams(cfg: TrainConfig) -> dict[str, Any]:
    """The composed, validated config as nested plain data (enums by name), as loggers take hyperparameters."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def run_hparams(cfg: TrainConfig) -> dict[str, Any]:
    """The choices that define a run, as TensorBoard's HParams tab compares runs by (the rest of the
    config goes to the Text tab): ZeRO stage, offload, precision, pipeline, model preset and size,
    world size, global batch (samples per optimizer step), optimizer (``onebit_adam`` apart from ``adamw``),
    learning rate."""
    from lightning_zero.config.validate import count_model_parameters, offload_name

    t, p = cfg.trainer, cfg.pipeline
    model = cfg.model.preset if isinstance(cfg.model, GPTModelSchema) else cfg.model.kind
    data_parallel = data_parallel_size(cfg)
    micro_batches = p.micro_batches if p.stages > 1 else t.accumulate_grad_batches
    return {
        "zero_stage": cfg.zero.stage, "offload": offload_name(cfg), "precision": cfg.precision.name.value,
        "pipeline": "none" if p.stages == 1 else f"{p.stages} stages, {p.schedule.value}",
        "model": model, "params_M": round(count_model_parameters(cfg) / 1e6, 3), "world_size": t.devices,
        "global_batch": cfg.data.micro_batch_size * micro_batches * data_parallel,
        "optimizer": cfg.model.optimizer.value, "lr": cfg.model.lr,
    }


def build_strategy(cfg: TrainConfig) -> ZeroStrategy:
    """The configured :class:`~lightning_zero.ZeroStrategy` (from ``deepspeed_config`` when one is set)."""
    if cfg.deepspeed_config:
        return build_deepspeed_strategy(cfg)
    return ZeroStrategy(**strategy_arguments(cfg))


def build_logger(cfg: TrainConfig, run_dir: Path) -> Logger | bool:
    """The logger writing into ``run_dir/<logger.name>`` (no version sub-folder), or ``False``."""
    lg = cfg.logger
    if lg.kind is LoggerKind.tensorboard:
        return ZeroTensorBoardLogger(save_dir=str(run_dir), name=lg.name, version="",
                                 default_hp_metric=lg.default_hp_metric)
    if lg.kind is LoggerKind.csv:
        return CSVLogger(save_dir=str(run_dir), name=lg.name, version="")
    return False


def build_callbacks(cfg: TrainConfig, run_dir: Path) -> list[Callback]:
    """``ModelCheckpoint`` into ``run_dir/checkpoints`` when checkpointing is enabled, Lightning's model summary
    without unmeasured FLOPs (:class:`~lightning_zero.observability.model_summary.ZeroModelSummary`), and the
    progress lines of :class:`~lightning_zero.observability.progress.LineProgress` when stdout is not a terminal
    (on one, Lightning's bar)
    unless ``trainer.enable_progress_bar=false`` (the strategy adds the :class:`~lightning_zero.ZeroStatsMonitor`
    itself, ``logger.monitor``)."""
    ck = cfg.trainer.checkpoint
    out: list[Callback] = []
    if cfg.trainer.enable_progress_bar and not sys.stdout.isatty():
        out.append(LineProgress())
    if cfg.trainer.enable_model_summary:
        out.append(ZeroModelSummary())  # no column of unmeasured FLOPs
    if ck.enabled:
        out.append(ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), save_last=ck.save_last,
                                   save_top_k=ck.save_top_k, monitor=ck.monitor,
                                   every_n_train_steps=ck.every_n_train_steps))
    return out


def val_check_batches(cfg: TrainConfig) -> float | None:
    """``trainer.val_check_interval`` as Lightning counts it: the config's whole number (> 1) counts optimizer
    steps, Lightning's counts training batches, so it is multiplied by the accumulation (a fraction <= 1 of
    an epoch is passed as it is)."""
    t = cfg.trainer
    value = t.val_check_interval
    if value is None or value <= 1 or not float(value).is_integer():
        return value
    return int(value) * t.accumulate_grad_batches


def val_batches_per_rank(cfg: TrainConfig) -> float | int | None:
    """``trainer.limit_val_batches`` as Lightning counts it (per rank).

    Note [global validation batches]
        A whole number N (> 1) counts validation batches over all data-parallel replicas together, so that
        every layout of one run (1 rank, a pipeline, TP, data parallel) validates on the same samples: each of
        the D replicas takes N / D batches. When D does not divide N, each takes N / D rounded up (D x that in
        all, said in the log). A fraction (<= 1: 1.0 is all) is passed as it is. ``trainer.limit_train_batches``
        keeps Lightning's per-rank count.
    """
    value = cfg.trainer.limit_val_batches
    if value is None or value <= 1 or not float(value).is_integer():
        return value
    data = data_parallel_size(cfg)
    per_rank = -(-int(value) // data)  # an int: Lightning reads 1.0 as "all", 1 as one batch
    if per_rank * data != int(value):
        rank_zero_info(f"trainer.limit_val_batches={int(value)} counts validation batches over all {data} "
                       f"data-parallel replicas, which do not divide it: each validates {per_rank} "
                       f"({per_rank * data} in all); a multiple of {data} avoids the rounding")
    return per_rank


def trainer_kwargs(cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    """``pl.Trainer`` arguments (strategy not included) for one rank of the run."""
    t = cfg.trainer
    optional = {"max_epochs": t.max_epochs, "max_time": t.max_time, "val_check_interval": val_check_batches(cfg),
                "limit_train_batches": t.limit_train_batches, "limit_val_batches": val_batches_per_rank(cfg),
                "gradient_clip_val": t.gradient_clip_val}
    return {
        "accelerator": t.accelerator, "devices": t.devices, "num_nodes": t.num_nodes, "max_steps": t.max_steps,
        "check_val_every_n_epoch": t.check_val_every_n_epoch, "num_sanity_val_steps": t.num_sanity_val_steps,
        "accumulate_grad_batches": t.accumulate_grad_batches, "log_every_n_steps": t.log_every_n_steps,
        "enable_progress_bar": t.enable_progress_bar, "enable_model_summary": t.enable_model_summary,
        "deterministic": t.deterministic, "default_root_dir": str(run_dir),
        "logger": build_logger(cfg, run_dir), "callbacks": build_callbacks(cfg, run_dir),
        "enable_checkpointing": t.checkpoint.enabled,
        **{k: v for k, v in optional.items() if v is not None},
    }


def _val_loss(metrics: list[dict[str, float]] | dict[str, Any]) -> float | None:
    found = metrics[0].get("val_loss") if isinstance(metrics, list) and metrics else None
    if isinstance(metrics, dict):
        found = metrics.get("val_loss")
    value = None if found is None else float(found)
    return value if value is None or math.isfinite(value) else None


class _LastValidation(Callback):
    """The global step of the last validation inside the fit (``validate_at_end`` does not repeat it), the
    step the fit started at, and, for a resumed fit, the start validation's line with the checkpoint's step
    (it ran before the fit restored the step, so its own line would have said step 0)."""

    step = -1
    started_at = 0
    start_line: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started_at = trainer.global_step
        if self.start_line is not None and trainer.is_global_zero:
            print(f"step {trainer.global_step}  val_loss {self.start_line:.4f}", file=sys.stderr, flush=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.step = trainer.global_step


def _validate_at_start(trainer: pl.Trainer, module: pl.LightningModule, data: pl.LightningDataModule,
                       resume_from: str | None) -> float | None:
    """The validation loss the fit starts from. A resumed fit starts from the checkpoint: its weights are
    loaded for this pass, which is not logged (the run that wrote the checkpoint logged that point)."""
    if not resume_from:
        return _val_loss(trainer.validate(module, data, verbose=False))
    loggers, trainer.loggers = trainer.loggers, []
    printers = [c for c in trainer.callbacks if isinstance(c, LineProgress)]
    for printer in printers:  # its line would say step 0: _LastValidation prints it once the step is restored
        printer.disable()
    try:
        return _val_loss(trainer.validate(module, data, ckpt_path=resume_from, verbose=False))
    finally:
        trainer.loggers = loggers
        for printer in printers:
            printer.enable()


def run_layout(strategy: pl.strategies.Strategy) -> dict[str, int]:
    """The dimensions the strategy's mesh spans and how many modules its tensor-parallel plan split: what ran,
    whatever the config asked (``result.json``'s ``layout``)."""
    return strategy.layout() if isinstance(strategy, ZeroStrategy) else {}  # Lightning's own strategies: no mesh


def fit(cfg: TrainConfig, run_dir: str | Path) -> FitResult:
    """Train ``cfg`` in this process (one rank, or the only one) and return what happened.

    With ``trainer.validate_at_start`` / ``validate_at_end`` the validation loss is measured before the
    first and after the last step (also written to the logger). The logger gets the whole config as
    hyperparameters (nested keys, ``/``-separated: ``zero/stage``, ``precision/name``, ...).
    """
    run_dir = Path(run_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    module, data = build_module(cfg), build_datamodule(cfg)
    kwargs = trainer_kwargs(cfg, run_dir)
    last_validation = _LastValidation()
    kwargs["callbacks"] = [*kwargs["callbacks"], last_validation]
    strategy = build_strategy(cfg)
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    log_hyperparams(trainer, run_hparams(cfg))  # first: TensorBoard's HPARAMS tab shows the first it finds
    for logger in trainer.loggers:
        if isinstance(logger, ZeroTensorBoardLogger):
            logger.log_config_text(to_yaml(cfg))
        else:
            logger.log_hyperparams(config_hparams(cfg))
    start = _validate_at_start(trainer, module, data, cfg.trainer.resume_from) if cfg.trainer.validate_at_start \
        else None
    if cfg.trainer.resume_from and start is not None and any(isinstance(c, LineProgress) for c in trainer.callbacks):
        last_validation.start_line = start
    began = time.perf_counter()
    trainer.fit(module, data, ckpt_path=cfg.trainer.resume_from)
    seconds = time.perf_counter() - began
    if cfg.trainer.validate_at_end and last_validation.step != trainer.global_step:  # else it just ran
        end = _val_loss(trainer.validate(module, data, verbose=False))
    else:
        end = _val_loss(dict(trainer.callback_metrics))
    ckpt_dir = run_dir / "checkpoints"
    ckpts = sorted(p.name for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    result = FitResult(trainer.global_step, seconds, start, end, ckpts, resumed_at=last_validation.started_at,
                       layout=run_layout(strategy))
    if trainer.local_rank == 0:  # every node's launcher reads it from its own run directory
        (run_dir / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result
