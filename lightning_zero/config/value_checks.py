"""The values of a composed config on their own: ranges of the model's, the data's and the Trainer's numbers, and
the Trainer's counts and shares (Note [counts and shares] in ``config/schema.py``), each with its fix."""

from __future__ import annotations

import re

from lightning_zero.config.schema import (
    DataSchema,
    GPTModelSchema,
    MLPModelSchema,
    ModelSchema,
    TextDataSchema,
    TrainConfig,
)


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


def value_problems(cfg: TrainConfig) -> list[str]:
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
