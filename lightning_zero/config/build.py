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
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from omegaconf import OmegaConf

from lightning_zero.config.schema import (
    LIGHTNING_PRECISION,
    GPTModelSchema,
    LoggerKind,
    MLPModelSchema,
    TeacherDataSchema,
    TextDataSchema,
    TrainConfig,
)
from lightning_zero.config.validate import gpt_overrides, import_object, offload_config, zero_config
from lightning_zero.core.loss_scaler import LossScalerConfig
from lightning_zero.monitoring import ProfilerWindow, log_hyperparams
from lightning_zero.precision import ZeroPrecision
from lightning_zero.strategy import ZeroStrategy

RESULT_FILE = "result.json"


def strategy_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """Keyword arguments of :class:`~lightning_zero.ZeroStrategy` for ``cfg``."""
    extra = tuple(import_object(p) for p in cfg.zero.elementwise_optimizers)
    units = tuple(import_object(p) for p in cfg.zero.unit_classes)
    return {
        "config": replace(zero_config(cfg), elementwise_optimizers=extra, unit_classes=units),
        "precision": build_precision(cfg),
        "check_step_errors": cfg.zero.check_step_errors,
        "process_group_backend": cfg.trainer.process_group_backend,
        "monitor": cfg.logger.monitor,
        "profiler": build_profiler(cfg),
        "offload": offload_config(cfg),
    }


def build_profiler(cfg: TrainConfig) -> ProfilerWindow | None:
    """The monitor's profiler window of ``cfg.profiler`` (``None`` unless enabled)."""
    p = cfg.profiler
    if not p.enabled:
        return None
    return ProfilerWindow(wait=p.wait, warmup=p.warmup, active=p.active, repeat=p.repeat,
                          record_shapes=p.record_shapes, with_stack=p.with_stack)


def config_hparams(cfg: TrainConfig) -> dict[str, Any]:
    """The composed, validated config as nested plain data (enums by name), as loggers take hyperparameters."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def build_precision(cfg: TrainConfig) -> ZeroPrecision:
    """The :class:`~lightning_zero.ZeroPrecision` of ``cfg.precision`` (fp16 on CPU stays fp16)."""
    p = cfg.precision
    name = LIGHTNING_PRECISION[p.name.value]
    scaler = None
    if name == "16-mixed":
        scaler = LossScalerConfig(loss_scale=p.loss_scale, initial_scale_power=p.initial_scale_power,
                                  loss_scale_window=p.loss_scale_window, hysteresis=p.hysteresis,
                                  consecutive_hysteresis=p.consecutive_hysteresis, min_loss_scale=p.min_loss_scale,
                                  raise_at_min_scale=p.raise_at_min_scale)
    return ZeroPrecision(name, loss_scaler=scaler, reduce_dtype=p.reduce_dtype, grad_accum_dtype=p.grad_accum_dtype)


def build_strategy(cfg: TrainConfig) -> ZeroStrategy:
    """The configured :class:`~lightning_zero.ZeroStrategy` (from ``deepspeed_config`` when one is set)."""
    if cfg.deepspeed_config:
        from lightning_zero.config.deepspeed import build_deepspeed_strategy

        return build_deepspeed_strategy(cfg)
    return ZeroStrategy(**strategy_kwargs(cfg))


def build_module(cfg: TrainConfig) -> pl.LightningModule:
    """The LightningModule of ``cfg.model`` (built in the current default device, e.g. meta)."""
    m = cfg.model
    if isinstance(m, GPTModelSchema):
        from experiments.gpt import GPTLightningModule

        return GPTLightningModule(
            model=m.preset, lr=m.lr, weight_decay=m.weight_decay, betas=list(m.betas), warmup_steps=m.warmup_steps,
            optimizer=m.optimizer.value, scheduler=m.scheduler.value, lr_decay_steps=m.lr_decay_steps,
            min_lr_ratio=m.min_lr_ratio, model_overrides=gpt_overrides(m) or None,
            build_in_configure_model=m.build_in_configure_model,
        )
    if isinstance(m, MLPModelSchema):
        from experiments.mlp import MLPClassifier

        return MLPClassifier(input_dim=m.input_dim, hidden_dim=m.hidden_dim, num_layers=m.num_layers,
                             num_classes=m.num_classes, lr=m.lr, weight_decay=m.weight_decay,
                             optimizer=m.optimizer.value)
    raise ValueError(f"no builder for model.kind={m.kind!r}")


def build_datamodule(cfg: TrainConfig) -> pl.LightningDataModule:
    """The LightningDataModule of ``cfg.data``."""
    d = cfg.data
    if isinstance(d, TextDataSchema):
        from experiments.data import TextDataModule

        return TextDataModule(seq_len=d.seq_len, micro_batch_size=d.micro_batch_size, num_workers=d.num_workers,
                              max_bytes=d.max_bytes, path=d.path, val_fraction=d.val_fraction, seed=d.seed,
                              deterministic_order=d.deterministic_order, max_val_samples=d.max_val_samples,
                              synthetic=d.synthetic, pattern=d.pattern)
    if isinstance(d, TeacherDataSchema):
        from experiments.mlp import TeacherDataModule

        return TeacherDataModule(num_train=d.num_train, num_val=d.num_val, input_dim=d.input_dim,
                                 num_classes=d.num_classes, micro_batch_size=d.micro_batch_size,
                                 num_workers=d.num_workers, seed=d.seed, deterministic_order=d.deterministic_order)
    raise ValueError(f"no builder for data.kind={d.kind!r}")


def build_logger(cfg: TrainConfig, run_dir: Path) -> Logger | bool:
    """The logger writing into ``run_dir/<logger.name>`` (no version sub-folder), or ``False``."""
    lg = cfg.logger
    if lg.kind is LoggerKind.tensorboard:
        return TensorBoardLogger(save_dir=str(run_dir), name=lg.name, version="",
                                 default_hp_metric=lg.default_hp_metric)
    if lg.kind is LoggerKind.csv:
        return CSVLogger(save_dir=str(run_dir), name=lg.name, version="")
    return False


def build_callbacks(cfg: TrainConfig, run_dir: Path) -> list[Callback]:
    """``ModelCheckpoint`` into ``run_dir/checkpoints`` when checkpointing is enabled (the strategy adds
    the :class:`~lightning_zero.ZeroStatsMonitor` itself, ``logger.monitor``)."""
    ck = cfg.trainer.checkpoint
    out: list[Callback] = []
    if ck.enabled:
        out.append(ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), save_last=ck.save_last,
                                   save_top_k=ck.save_top_k, monitor=ck.monitor,
                                   every_n_train_steps=ck.every_n_train_steps))
    return out


def trainer_kwargs(cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    """``pl.Trainer`` arguments (strategy not included) for one rank of the run."""
    t = cfg.trainer
    optional = {"max_epochs": t.max_epochs, "max_time": t.max_time, "val_check_interval": t.val_check_interval,
                "limit_train_batches": t.limit_train_batches, "limit_val_batches": t.limit_val_batches,
                "gradient_clip_val": t.gradient_clip_val}
    return {
        "accelerator": t.accelerator, "devices": t.devices, "max_steps": t.max_steps,
        "check_val_every_n_epoch": t.check_val_every_n_epoch, "num_sanity_val_steps": t.num_sanity_val_steps,
        "accumulate_grad_batches": t.accumulate_grad_batches, "log_every_n_steps": t.log_every_n_steps,
        "enable_progress_bar": t.enable_progress_bar, "enable_model_summary": t.enable_model_summary,
        "deterministic": t.deterministic, "default_root_dir": str(run_dir),
        "logger": build_logger(cfg, run_dir), "callbacks": build_callbacks(cfg, run_dir),
        "enable_checkpointing": t.checkpoint.enabled,
        **{k: v for k, v in optional.items() if v is not None},
    }


@dataclass
class FitResult:
    """What one run did (rank 0 writes it to ``run_dir/result.json``)."""

    global_step: int
    seconds: float
    val_loss_start: float | None
    val_loss_end: float | None
    checkpoints: list[str]

    def summary(self) -> str:
        """One line: steps, fit time, validation loss at start and end, and the drop."""

        def fmt(x: float | None) -> str:
            return "-" if x is None else f"{x:.4f}"

        drop = ("" if self.val_loss_start is None or self.val_loss_end is None
                else f" (drop {self.val_loss_start - self.val_loss_end:.3f} nats)")
        return (f"steps={self.global_step} fit_time={self.seconds:.1f}s val_loss {fmt(self.val_loss_start)} -> "
                f"{fmt(self.val_loss_end)}{drop}")


def _val_loss(metrics: list[dict[str, float]] | dict[str, Any]) -> float | None:
    found = metrics[0].get("val_loss") if isinstance(metrics, list) and metrics else None
    if isinstance(metrics, dict):
        found = metrics.get("val_loss")
    value = None if found is None else float(found)
    return value if value is None or math.isfinite(value) else None


def fit(cfg: TrainConfig, run_dir: str | Path) -> FitResult:
    """Train ``cfg`` in this process (one rank, or the only one) and return what happened.

    With ``trainer.validate_at_start`` / ``validate_at_end`` the validation loss is measured before the
    first and after the last step (also written to the logger). The logger gets the whole config as
    hyperparameters (nested keys, ``/``-separated: ``zero/stage``, ``precision/name``, ...).
    """
    run_dir = Path(run_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    module, data = build_module(cfg), build_datamodule(cfg)
    trainer = pl.Trainer(strategy=build_strategy(cfg), **trainer_kwargs(cfg, run_dir))
    log_hyperparams(trainer, config_hparams(cfg))  # first: TensorBoard's HPARAMS tab shows the first it finds
    start = _val_loss(trainer.validate(module, data, verbose=False)) if cfg.trainer.validate_at_start else None
    began = time.perf_counter()
    trainer.fit(module, data, ckpt_path=cfg.trainer.resume_from)
    seconds = time.perf_counter() - began
    if cfg.trainer.validate_at_end:
        end = _val_loss(trainer.validate(module, data, verbose=False))
    else:
        end = _val_loss(dict(trainer.callback_metrics))
    ckpt_dir = run_dir / "checkpoints"
    ckpts = sorted(p.name for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    result = FitResult(trainer.global_step, seconds, start, end, ckpts)
    if trainer.is_global_zero:
        (run_dir / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2) + "\n")
        print(f"[lightning-zero] {cfg.name}: {result.summary()}", flush=True)
    return result
