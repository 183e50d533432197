"""A tiny language model following the pipeline protocol, its data and a plain-PyTorch reference
(shared by tests/e2e/test_pipeline.py and its worker processes)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.core.stage3.materialize import parameters_on_meta
from lightning_zero.pipeline.build import materialize_whole
from tests.models import RankSampler

VOCAB, WIDTH, SEQ = 13, 8, 6


class Embed(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)


class Block(nn.Module):
    calls = 0  # forward calls in this process (activation checkpointing runs them again in backward)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + torch.tanh(self.fc(x))


class Head(nn.Module):
    def __init__(self, norm: nn.LayerNorm, out: nn.Linear) -> None:
        super().__init__()
        self.norm, self.out = norm, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class PipeLM(pl.LightningModule):
    """Embedding (tied to the output head), ``n_blocks`` residual blocks, a norm and the head."""

    def __init__(self, optimizer: str = "adamw", n_blocks: int = 3, tie: bool = True, lr: float = 0.05,
                 lazy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.n_blocks, self.tie = n_blocks, tie
        self.optimizer_name, self.lr = optimizer, lr
        self.losses: list[float] = []
        self.built_bytes: int | None = None  # lazy: parameter bytes held right after configure_model
        if not lazy:
            self._build()

    def _build(self) -> None:
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(self.n_blocks))
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)
        if self.tie:
            self.out.weight = self.emb.weight

    def configure_model(self) -> None:
        if not hasattr(self, "emb"):  # lazy: built here (under a pipeline, on the meta device)
            self._build()
            self.built_bytes = param_bytes(self)

    def pipeline_layers(self) -> list[nn.Module]:
        return [Embed(self.emb), *self.blocks, Head(self.norm, self.out)]

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters(), self.lr)


def param_bytes(module: nn.Module) -> int:
    """Bytes of the storages behind ``module``'s parameters (meta ones hold none; a placeholder one element)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()
                if not p.is_meta}
    return sum(storages.values())


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def dataset(n: int = 96) -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loader(batch: int, dp_rank: int = 0, dp_size: int = 1, n: int = 96) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch, sampler=RankSampler(n, dp_rank, dp_size))


def reference(optimizer: str, batch: int, dp_size: int, steps: int, clip: float | None = None,
              n: int = 96, lazy: bool = False, tie: bool = True) -> dict[str, Any]:
    """Plain PyTorch on one process: each step averages the data-parallel ranks' batch losses (what
    data-parallel training computes), then clips and steps; epochs restart the unshuffled data. ``lazy``:
    the model built in ``configure_model`` on the meta device, materialised whole."""
    model = PipeLM(optimizer, lazy=lazy, tie=tie)
    if lazy:  # built on meta and initialised as each pipeline stage initialises its part
        with parameters_on_meta():
            model.configure_model()
        materialize_whole(model, None, torch.initial_seed())
    opt = model.configure_optimizers()
    batches = [list(loader(batch, r, dp_size, n)) for r in range(dp_size)]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        pairs = [b[step % len(b)] for b in batches]
        per_rank = [model.pipeline_loss(model(x), y) for x, y in pairs]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append([float(t) for t in per_rank])
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
