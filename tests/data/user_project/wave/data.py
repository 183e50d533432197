"""A noisy sine wave, made in ``setup`` from the module's own seed."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class WaveData(pl.LightningDataModule):
    def __init__(self, num_samples: int = 256, batch_size: int = 16, noise: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.hparams.seed)
        x = torch.rand(self.hparams.num_samples, 1, generator=g) * 2 * math.pi
        y = torch.sin(x) + self.hparams.noise * torch.randn(x.shape, generator=g)
        n_val = self.hparams.num_samples // 8
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
