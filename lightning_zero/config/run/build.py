"""From a validated :class:`~lightning_zero.config.schema.TrainConfig` to a finished Lightning fit.

Each ``build_*`` function converts one part (strategy, module, data, logger, callbacks, Trainer
arguments); :func:`fit` runs them in the current process, which is one rank: the launcher
(:mod:`lightning_zero.config.run.launch`) starts the ranks with ``torch.distributed.run``, so Lightning
finds its environment there and never re-launches ``sys.argv``. Everything a run writes goes into
``run_dir``: TensorBoard events under ``tb/``, checkpoints under ``checkpoints/``, ``result.json``.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from omegaconf import OmegaConf

from lightning_zero.checkpoint.reader import resume_path
from lightning_zero.config.model_zoo import build_datamodule, build_module, param_init_fn
from lightning_zero.config.parallel_checks import data_parallel_size
from lightning_zero.config.paths import RESULT_FILE, EvalResult, FitResult
from lightning_zero.config.schema import (
    GPTModelSchema,
    LoggerKind,
    LoggerSchema,
    ModelSchema,
    TrainConfig,
    to_container,
    to_yaml,
)
from lightning_zero.config.settings import settings_of
from lightning_zero.config.value_checks import counts, val_check_batches
from lightning_zero.core.stage3.sharded_unit import is_released
from lightning_zero.deepspeed.strategy import DeepSpeedZeroStrategy
from lightning_zero.lightning.strategy import ZeroStrategy
from lightning_zero.observability.dashboard import ZeroTensorBoardLogger
from lightning_zero.observability.model_summary import ZeroModelSummary
from lightning_zero.observability.monitoring import ProfilerWindow, log_hyperparams
from lightning_zero.observability.progress import LineProgress
from lightning_zero.project.instantiate import instantiate_entries
from lightning_zero.project.targets import TargetNode


def strategy_arguments(cfg: TrainConfig, module: pl.LightningModule | None = None) -> dict[str, Any]:
    """Keyword arguments of :class:`~lightning_zero.ZeroStrategy` for ``cfg``: its settings tree
    (:func:`~lightning_zero.config.settings.settings_of`) and the strategy's other arguments (``module``: the one
    :func:`build_module` made, whose weights a Hugging Face model reads into the shards)."""
    return {
        "settings": settings_of(cfg),
        "check_step_errors": cfg.zero.check_step_errors,
        "gather_on_teardown": cfg.zero.gather_on_teardown,
        "process_group_backend": cfg.trainer.process_group_backend,
        "monitor": cfg.logger.monitor if isinstance(cfg.logger, LoggerSchema) else True,
        "profiler": build_profiler(cfg),
        "param_init_fn": param_init_fn(cfg, module),
        "resolved_config": config_hparams(cfg),  # compared across ranks at setup (Note [setup agreement])
    }


def build_deepspeed_strategy(cfg: TrainConfig, module: pl.LightningModule | None = None) -> ZeroStrategy:
    """The ranks' strategy for a merged, typed config with ``deepspeed_config``: the Hydra-side strategy
    arguments (equal to the JSON's wherever the JSON sets a value, after
    :func:`~lightning_zero.config.run.deepspeed.apply_deepspeed_config`) as overrides of
    ``DeepSpeedZeroStrategy.from_deepspeed_config``, whose optimizer / scheduler sections replace the model's."""
    return DeepSpeedZeroStrategy.from_deepspeed_config(cfg.deepspeed_config, strict=cfg.deepspeed_strict,
                                              optimizer_source="config", **strategy_arguments(cfg, module))


def build_profiler(cfg: TrainConfig) -> ProfilerWindow | None:
    """The monitor's profiler window of ``cfg.profiler`` (``None`` unless enabled)."""
    p = cfg.profiler
    if not p.enabled:
        return None
    return ProfilerWindow(**{f.name: getattr(p, f.name) for f in fields(ProfilerWindow)})


def config_hparams(cfg: TrainConfig) -> dict[str, Any]:
    """The composed, validated config as nested plain data (enums by name), as loggers take hyperparameters."""
    data = OmegaConf.to_container(to_container(cfg), resolve=True, enum_to_str=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def run_hparams(cfg: TrainConfig) -> dict[str, Any]:
    """The choices that define a run, as TensorBoard's HParams tab compares runs by (the rest of the
    config goes to the Text tab): ZeRO stage, offload, precision, pipeline, tensor and sequence parallel,
    attention, optimizer (``onebit_adam`` apart from ``adamw``) (``validate.run_choices``), model preset and size,
    world size, global batch (samples per optimizer step), learning rate (those known for a ``_target_`` model)."""
    from lightning_zero.config.describe import count_model_parameters, run_choices

    t, p, m = cfg.trainer, cfg.pipeline, cfg.model
    model = m.preset if isinstance(m, GPTModelSchema) else m.target if isinstance(m, TargetNode) else m.kind
    data_parallel = data_parallel_size(cfg)
    micro_batches = p.micro_batches if p.stages > 1 else t.accumulate_grad_batches
    params, batch = count_model_parameters(cfg), getattr(cfg.data, "micro_batch_size", None)
    out = {
        **run_choices(cfg), "model": model, "params_M": None if params is None else round(params / 1e6, 3),
        "world_size": t.devices, "global_batch": None if batch is None else batch * micro_batches * data_parallel,
    }
    if isinstance(m, ModelSchema):
        out.update(lr=m.lr)
    return {k: v for k, v in out.items() if v is not None}


def build_strategy(cfg: TrainConfig, module: pl.LightningModule | None = None) -> ZeroStrategy:
    """The configured :class:`~lightning_zero.ZeroStrategy` (from ``deepspeed_config`` when one is set; ``module``:
    the LightningModule :func:`build_module` made)."""
    if cfg.deepspeed_config:
        return build_deepspeed_strategy(cfg, module)
    return ZeroStrategy(**strategy_arguments(cfg, module))


def build_logger(cfg: TrainConfig, run_dir: Path) -> Logger | list[Logger] | bool:
    """The logger writing into ``run_dir/<logger.name>`` (no version sub-folder), or ``False``; a ``_target_``
    logger (or several) is the user's, with ``save_dir=run_dir`` when it takes one and sets none."""
    lg = cfg.logger
    if isinstance(lg, (TargetNode, dict)):
        entries = lg if isinstance(lg, dict) else {lg.key: lg}
        return instantiate_entries(entries, {"save_dir": str(run_dir)}) or False
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
    itself, ``logger.monitor``), then the user's ``callbacks`` (``_target_`` nodes) in the config's order."""
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
    return out + instantiate_entries(cfg.callbacks)  # the user's own, `callbacks.<name>._target_`


def val_batches_per_rank(cfg: TrainConfig) -> float | int | None:
    """``trainer.limit_val_batches`` as Lightning counts it (per rank).

    Note [global validation batches]
        A whole number N counts validation batches over all data-parallel replicas together, so that every
        layout of one run (1 rank, a pipeline, TP, data parallel) validates on the same samples: each of the D
        replicas takes N / D batches. When D does not divide N, each takes N / D rounded up (D x that in all,
        said in the log). A fraction (a float <= 1: 1.0 is all, 1 is one batch: Note [counts and shares] in
        config/schema.py) is passed as it is. ``trainer.limit_train_batches`` keeps Lightning's per-rank count.
    """
    value = cfg.trainer.limit_val_batches
    if value is None or not counts(value):
        return value
    data = data_parallel_size(cfg)
    per_rank = -(-int(value) // data)  # an int: Lightning reads 1.0 as "all", 1 as one batch
    if per_rank * data != int(value):
        rank_zero_info(f"trainer.limit_val_batches={int(value)} counts validation batches over all {data} "
                       f"data-parallel replicas, which do not divide it: each validates {per_rank} "
                       f"({per_rank * data} in all); a multiple of {data} avoids the rounding")
    return per_rank


def count_or_share_lines(cfg: TrainConfig) -> list[str]:
    """What each set ``trainer.limit_*_batches`` / ``val_check_interval`` means, a count or a share (Note [counts
    and shares] in config/schema.py): the log says it, since ``1`` and ``1.0`` differ."""
    t, lines = cfg.trainer, []
    for key, count, share in (
        ("limit_train_batches", "training batches per rank and epoch", "of the training batches"),
        ("limit_val_batches", "validation batches of all data-parallel replicas together", "of the validation batches"),
        ("val_check_interval", "optimizer steps between validations", "of a training epoch between validations"),
    ):
        value = getattr(t, key)
        if value is None:
            continue
        if counts(value):
            lines.append(f"trainer.{key}={value} is a count: {count} (a fraction such as 1.0 would be a share)")
        else:
            lines.append(f"trainer.{key}={value} is a share: {value:.0%} {share} (a whole number such as 1 would "
                         "be a count)")
    return lines


def trainer_kwargs(cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    """``pl.Trainer`` arguments (strategy not included) for one rank of the run."""
    t = cfg.trainer
    for line in count_or_share_lines(cfg):
        rank_zero_info(line)
    optional = {"max_epochs": t.max_epochs, "max_time": t.max_time, "val_check_interval": val_check_batches(cfg),
                "limit_train_batches": t.limit_train_batches, "limit_val_batches": val_batches_per_rank(cfg),
                "gradient_clip_val": t.gradient_clip_val}
    return {
        "accelerator": t.accelerator, "devices": t.devices, "num_nodes": t.num_nodes, "max_steps": t.max_steps,
        "check_val_every_n_epoch": t.check_val_every_n_epoch, "num_sanity_val_steps": t.num_sanity_val_steps,
        "accumulate_grad_batches": t.accumulate_grad_batches, "log_every_n_steps": t.log_every_n_steps,
        # the summary is ours when asked for (build_callbacks): Lightning adds none, and says nothing about it
        "enable_progress_bar": t.enable_progress_bar, "enable_model_summary": False,
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
    (it ran before the fit restored the step, so its own line would have said step 0).

    With ``at_last_step`` (``trainer.validate_at_end``) the last step asks Lightning to stop there
    (``should_stop``), which makes it validate inside the fit, with the final weights (Note [end validation
    inside the fit]).

    Note [end validation inside the fit]
        ``trainer.validate_at_end`` measures the validation loss of the final weights. Run after the fit, it would
        need the whole model back on every rank, which at stage 3 is the end-of-fit gather (Note [teardown
        gather]): the largest allocation of the run, on the run's last second. Inside the fit, at its last step
        (the last of ``max_steps``, or the last batch of the last epoch; ``max_time`` stops the same way), it
        validates through the sharded engine like any validation, so the CLI gathers nothing at teardown
        (``zero.gather_on_teardown=false``). A fit that ends otherwise without a validation at its last step is
        validated after it, where the weights are whole (stages 0-2, or a gather that fit), else it says why not.
    """

    step = -1
    started_at = 0
    start_line: float | None = None

    def __init__(self, at_last_step: bool = False) -> None:
        self.at_last_step = at_last_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.at_last_step:
            return
        epochs = trainer.fit_loop
        last_epoch = trainer.max_epochs is not None and trainer.max_epochs > 0 and \
            trainer.current_epoch + 1 >= trainer.max_epochs and epochs.epoch_loop.batch_progress.is_last_batch
        if (0 < trainer.max_steps <= trainer.global_step) or last_epoch:
            trainer.should_stop = True  # Lightning then validates this step (check_val_every_n_epoch permitting)

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


def _validate_after_fit(trainer: pl.Trainer, module: pl.LightningModule, data: pl.LightningDataModule) -> float | None:
    """``validate_at_end`` for a fit that did not validate at its last step (Note [end validation inside the fit]):
    with the whole weights, or ``None`` and a warning where stage 3 left them released (no gather at teardown)."""
    if not trainer.enable_validation:  # no validation data or batches: nothing to measure, as inside the fit
        return None
    if any(is_released(p) for p in module.parameters()):
        rank_zero_warn(
            f"trainer.validate_at_end: the fit ended at step {trainer.global_step} without a validation there, and "
            "its stage-3 parameters were not gathered back after it (zero.gather_on_teardown=false, or they did not "
            "fit), so there is no end validation (val_loss_end is null). A validation at the last step runs inside "
            "the fit: keep check_val_every_n_epoch at 1, or set zero.gather_on_teardown=true.")
        return None
    return _val_loss(trainer.validate(module, data, verbose=False))


def run_layout(strategy: pl.strategies.Strategy) -> dict[str, int]:
    """The dimensions the strategy's mesh spans and how many modules its tensor-parallel plan and its expert
    parallelism split: what ran, whatever the config asked (``result.json``'s ``layout``)."""
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
    last_validation = _LastValidation(at_last_step=cfg.trainer.validate_at_end)
    kwargs["callbacks"] = [*kwargs["callbacks"], last_validation]
    strategy = build_strategy(cfg, module)
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    log_hyperparams(trainer, run_hparams(cfg))  # first: TensorBoard's HPARAMS tab shows the first it finds
    for logger in trainer.loggers:
        if isinstance(logger, ZeroTensorBoardLogger):
            logger.log_config_text(to_yaml(cfg))
        else:
            logger.log_hyperparams(config_hparams(cfg))
    resume = str(resume_path(cfg.trainer.resume_from)) if cfg.trainer.resume_from else None  # a folder: last.ckpt
    start = _validate_at_start(trainer, module, data, resume) if cfg.trainer.validate_at_start else None
    if resume and start is not None and any(isinstance(c, LineProgress) for c in trainer.callbacks):
        last_validation.start_line = start
    began = time.perf_counter()
    with warnings.catch_warnings():  # the CLI chose not to gather (Note [end validation inside the fit]): no news
        warnings.filterwarnings("ignore", message=r"ZeroStrategy\(gather_on_teardown=False\)")
        trainer.fit(module, data, ckpt_path=resume)
    seconds = time.perf_counter() - began
    if cfg.trainer.validate_at_end and last_validation.step != trainer.global_step:  # else it just ran
        end = _validate_after_fit(trainer, module, data)
    else:
        end = _val_loss(dict(trainer.callback_metrics))
    ckpt_dir = run_dir / "checkpoints"
    ckpts = sorted(p.name for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    result = FitResult(trainer.global_step, seconds, start, end, ckpts, resumed_at=last_validation.started_at,
                       layout=run_layout(strategy))
    if trainer.local_rank == 0:  # every node's launcher reads it from its own run directory
        (run_dir / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result


def evaluate(cfg: TrainConfig, run_dir: str | Path, command: str) -> EvalResult:
    """``lightning-zero validate / test / predict`` in this process (one rank): the model and data of ``cfg``, the
    Trainer's method ``command`` from ``cfg.ckpt_path`` (a checkpoint; ``None``: the initial weights). Rank 0
    writes ``result.json`` (the metrics); ``predict`` writes each rank's predictions to
    ``run_dir/predictions/rank<r>.pt`` (``torch.save`` of the list ``trainer.predict`` returns)."""
    import torch

    run_dir = Path(run_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    module, data = build_module(cfg), build_datamodule(cfg)
    off = replace(cfg.trainer.checkpoint, enabled=False)  # nothing to save: no ModelCheckpoint
    trainer = pl.Trainer(strategy=build_strategy(cfg, module),
                         **trainer_kwargs(replace(cfg, trainer=replace(cfg.trainer, checkpoint=off)), run_dir))
    out = getattr(trainer, command)(module, data, ckpt_path=cfg.ckpt_path)
    result = EvalResult(command, cfg.ckpt_path)
    if command == "predict":
        (run_dir / "predictions").mkdir(exist_ok=True)
        torch.save(out, run_dir / "predictions" / f"rank{trainer.global_rank}.pt")
        result.predictions = [f"predictions/rank{r}.pt" for r in range(trainer.world_size)]
    else:
        result.metrics = {k: float(v) for k, v in (out[0] if out else {}).items()}
    if trainer.local_rank == 0:
        (run_dir / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result
