"""``steps_per_print`` / ``wall_clock_breakdown`` of a DeepSpeed JSON: the rank-0 progress lines
(:class:`DeepSpeedReport`, added by ``DeepSpeedZeroStrategy`` at setup)."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class DeepSpeedReport(Callback):
    """``steps_per_print`` / ``wall_clock_breakdown``: a line on rank 0 every ``every`` optimizer steps with the
    LRs (and the loss scale when there is one), plus forward / backward / step milliseconds when timing."""

    def __init__(self, every: int, wall_clock: bool) -> None:
        self.every, self.wall_clock = every, wall_clock
        self._mark, self._stepping, self._printed = 0.0, False, -1
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    def _lap(self, name: str | None) -> None:
        now = time.perf_counter()
        if name is not None:
            self._times[name] += now - self._mark
        self._mark = now

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap(None)

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap("forward")

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap("backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap(None)
        self._stepping = True

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._stepping:
            self._lap("step")
            self._stepping = False
        step = trainer.global_step
        if step == 0 or step % self.every or self._printed == step:
            return
        self._printed = step
        lrs = [round(g["lr"], 10) for opt in trainer.optimizers for g in opt.param_groups]
        scale = getattr(trainer.strategy, "loss_scale", None)
        line = f"[lightning-zero] step={step} lr={lrs}" + ("" if scale is None else f" loss_scale={scale}")
        if self.wall_clock:
            line += " | " + " | ".join(f"{k}: {v * 1e3 / self.every:.2f} ms" for k, v in self._times.items())
            self._times = dict.fromkeys(self._times, 0.0)
        rank_zero_info(line)
