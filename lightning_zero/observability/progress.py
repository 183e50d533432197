"""Progress for a log file or a pipe: :class:`LineProgress` prints one line every few optimizer steps.

Lightning's bar redraws one terminal line with carriage returns, which a pipe, a CI log or ``train.log``
turn into thousands of fragments. The CLI uses Lightning's bar when stdout is a terminal and this
otherwise (``trainer.enable_progress_bar=false`` turns both off).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, Timer
from typing_extensions import override


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class LineProgress(ProgressBar):
    """A progress "bar" of plain lines, on global rank 0, e.g.
    ``step 20/100  loss 3.4121  tokens/s 12,345  elapsed 0:00:09  ETA 0:00:36``, and a line per validation.

    Args:
        every: a line every this many optimizer steps (default: the Trainer's ``log_every_n_steps``);
            the last step of ``max_steps`` always gets one.
        stream: where the lines go (default ``sys.stderr``, read at print time).
    """

    def __init__(self, every: int | None = None, stream: TextIO | None = None) -> None:
        super().__init__()
        if every is not None and every < 1:
            raise ValueError(f"LineProgress(every=...) must be >= 1, got {every}.")
        self.every = every
        self.stream = stream
        self._enabled = True
        self._began = 0.0
        self._first_step = 0
        self._last_step = -1

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    def _print(self, trainer: pl.Trainer, text: str) -> None:
        if self._enabled and trainer.is_global_zero:
            print(text, file=self.stream or sys.stderr, flush=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._began = time.perf_counter()
        self._first_step = self._last_step = trainer.global_step
        total = f"{trainer.max_steps} steps" if trainer.max_steps > 0 else "no step limit"
        resumed = f", resuming at step {trainer.global_step}" if trainer.global_step else ""
        self._print(trainer, f"training on {trainer.world_size} rank(s): {total}{resumed}")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # inside a gradient-accumulation window
        self._last_step = step
        every = self.every or trainer.log_every_n_steps or 1
        if step % every and step != trainer.max_steps:
            return
        metrics = self.get_metrics(trainer, pl_module)
        parts = [f"step {step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        for key in ("loss", "train_loss", "loss_scale", "tokens/s"):
            value = metrics.get(key)
            if isinstance(value, (int, float)):
                parts.append(f"{key} {value:,.0f}" if key == "tokens/s" else f"{key} {value:.4g}")
        elapsed = time.perf_counter() - self._began
        parts.append(f"elapsed {_clock(elapsed)}")
        done = step - self._first_step
        eta = elapsed / done * (trainer.max_steps - step) if trainer.max_steps > 0 and done > 0 else None
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)  # trainer.max_time
        left = timer.time_remaining("train") if timer is not None else None
        if left is not None and (eta is None or left < eta):
            parts.append(f"ETA {_clock(left)} (max_time)")
        elif eta is not None:
            parts.append(f"ETA {_clock(eta)}")
        self._print(trainer, "  ".join(parts))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get("val_loss")
        if value is not None:
            self._print(trainer, f"step {trainer.global_step}  val_loss {float(value):.4f}")
