"""Lightning callbacks of lightning_zero."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


class ZeroStatsMonitor(pl.Callback):
    """Logs :meth:`ZeroStrategy.step_stats` after every optimizer step: ``zero/loss_scale`` and
    ``zero/skipped_steps`` (fp16), ``zero/grad_norm`` (16-bit mixed modes, or when clipping by norm).

    A strategy cannot call ``self.log``; the values live on the strategy and this callback logs them
    through the LightningModule, so every logger (TensorBoard, CSV, ...) charts them. Nothing is
    logged under other strategies or in steps without values.

    Args:
        prog_bar: also show them in the progress bar.
    """

    def __init__(self, prog_bar: bool = False) -> None:
        self.prog_bar = prog_bar
        self._last_step = -1

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step_stats = getattr(trainer.strategy, "step_stats", None)
        if step_stats is None or trainer.global_step == self._last_step:  # no optimizer step in this batch
            return
        self._last_step = trainer.global_step
        stats = step_stats()
        if stats:
            pl_module.log_dict(stats, on_step=True, on_epoch=False, prog_bar=self.prog_bar, logger=True)
