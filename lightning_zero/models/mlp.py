"""A small MLP classifier on a deterministic synthetic "random teacher" task, for quick config tests."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.models.data import ShardedDataModule, log_train_loss


def teacher_dataset(
    num_samples: int, input_dim: int = 32, num_classes: int = 10, seed: int = 0, teacher_hidden: int = 64
) -> TensorDataset:
    """Gaussian inputs labelled by the argmax of a fixed random 2-layer tanh "teacher" network.

    The teacher is drawn from ``seed`` only, so datasets with different ``num_samples`` share the task.
    """
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(input_dim, teacher_hidden, generator=g) / input_dim**0.5
    w2 = torch.randn(teacher_hidden, num_classes, generator=g) / teacher_hidden**0.5
    x = torch.randn(num_samples, input_dim, generator=torch.Generator().manual_seed(seed + 1))
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x, y)


class TeacherDataModule(ShardedDataModule):
    """Train/validation splits of :func:`teacher_dataset`; ``deterministic_order`` as in ``TextDataModule``."""

    def __init__(
        self,
        num_train: int = 4096,
        num_val: int = 1024,
        input_dim: int = 32,
        num_classes: int = 10,
        micro_batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        deterministic_order: bool = False,
    ) -> None:
        super().__init__(micro_batch_size, num_workers, seed, deterministic_order)  # saves every argument

    def setup(self, stage: str | None = None) -> None:
        """Generate both splits (idempotent)."""
        if self.train_dataset is None:
            hp = self.hparams
            full = teacher_dataset(hp.num_train + hp.num_val, hp.input_dim, hp.num_classes, self.seed)
            x, y = full.tensors
            self.train_dataset = TensorDataset(x[: hp.num_train], y[: hp.num_train])
            self.val_dataset = TensorDataset(x[hp.num_train :], y[hp.num_train :])

    def val_dataloader(self) -> DataLoader:
        """Validation loader, in order (Lightning shards it)."""
        self.setup("validate")
        assert self.val_dataset is not None
        return self._loader(self.val_dataset, None, shuffle=False)


class MLPClassifier(LightningModule):
    """``num_layers`` hidden Linear+GELU layers and a linear head; logs ``train_loss``, ``val_loss``, ``val_acc``.

    The layers live in an ``nn.ModuleList`` named ``blocks`` (like :class:`lightning_zero.models.gpt.GPT`).
    """

    def __init__(
        self,
        input_dim: int = 32,
        hidden_dim: int = 128,
        num_layers: int = 2,
        num_classes: int = 10,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        optimizer: str = "adamw",
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "adam", "sgd"):
            raise ValueError(f"unknown optimizer {optimizer!r}")
        self.save_hyperparameters()
        self.blocks: nn.ModuleList | None = None
        self.head: nn.Linear | None = None
        if not build_in_configure_model:
            self.configure_model()

    def configure_model(self) -> None:
        """Build the layers if not built yet (idempotent)."""
        if self.blocks is not None:
            return
        hp = self.hparams
        dims = [hp.input_dim] + [hp.hidden_dim] * hp.num_layers
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.head = nn.Linear(dims[-1], hp.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for inputs ``x`` of shape ``(batch, input_dim)``."""
        assert self.blocks is not None and self.head is not None, "call configure_model() first"
        for layer in self.blocks:
            x = F.gelu(layer(x))
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        log_train_loss(self, loss, x.size(0))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=x.size(0))
        self.log("val_acc", acc, sync_dist=True, batch_size=x.size(0))
        return loss

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=0.9, weight_decay=hp.weight_decay)
        cls = torch.optim.AdamW if hp.optimizer == "adamw" else torch.optim.Adam
        return cls(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
