"""A callback that leaves a mark of every step it saw."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class StepTrace(pl.Callback):
    def __init__(self, filename: str = "steps.txt") -> None:
        self.filename = filename

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.is_global_zero:
            with open(Path(trainer.default_root_dir) / self.filename, "a") as f:
                f.write(f"{trainer.global_step}\n")
