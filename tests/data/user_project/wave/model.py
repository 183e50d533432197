"""An MLP regressing a noisy sine wave; its optimizer and scheduler are given to it (lightning-hydra-template's
convention: ``functools.partial`` objects it calls with its parameters)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn


class WaveNet(pl.LightningModule):
    def __init__(self, width: int = 16, depth: int = 2, dropout: float = 0.0,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, record_name: str = "record") -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        layers: list[nn.Module] = [nn.Linear(1, width), nn.Tanh(), nn.Dropout(dropout)]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout)]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        factory = self.optimizer_factory or (lambda params: torch.optim.SGD(params, lr=0.1))
        optimizer = factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer=optimizer),
                                                         "interval": "step"}}

    def on_train_end(self) -> None:
        """Each rank writes what it saw: its arguments, its optimizer, every training loss."""
        record = {"hparams": dict(self.hparams), "optimizer": type(self.trainer.optimizers[0]).__name__,
                  "lr": self.trainer.optimizers[0].param_groups[0]["lr"], "losses": self.losses,
                  "world_size": self.trainer.world_size}
        out = Path(self.trainer.default_root_dir) / f"{self.hparams.record_name}_rank{self.global_rank}.json"
        out.write_text(json.dumps(record))
