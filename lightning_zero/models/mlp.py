"""A small MLP classifier on a deterministic synthetic "random teacher" task, for quick config tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.models.data import ShardedDataModule, log_train_loss
from lightning_zero.models.mlp_parts import TeacherTask, mlp_layers, teacher_dataset


class TeacherDataModule(ShardedDataModule):
    """Train/validation splits of :func:`teacher_dataset`; ``deterministic_order`` as in ``TextDataModule``. The
    arguments are :class:`~lightning_zero.models.mlp_parts.TeacherTask`'s fields, with its defaults."""

    def __init__(
        self,
        num_train: int = TeacherTask.num_train,
        num_val: int = TeacherTask.num_val,
        input_dim: int = TeacherTask.input_dim,
        num_classes: int = TeacherTask.num_classes,
        micro_batch_size: int = TeacherTask.micro_batch_size,
        num_workers: int = TeacherTask.num_workers,
        seed: int = TeacherTask.seed,
        deterministic_order: bool = TeacherTask.deterministic_order,
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
        self.blocks, self.head = mlp_layers(hp.input_dim, hp.hidden_dim, hp.num_layers, hp.num_classes)

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
