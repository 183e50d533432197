"""Small models, data and helpers shared by the distributed tests (imported in pool workers)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

VOCAB = 17


class RankSampler(Sampler[int]):
    """A fixed, unshuffled shard of the indices per rank (Lightning's default sampler shuffles)."""

    def __init__(self, n: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):  # type: ignore[override]
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def token_loader(n: int = 96, seq: int = 9, batch_size: int = 4, seed: int = 1) -> DataLoader:
    rank, world = rank_and_world()
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, seq), generator=gen)
    return DataLoader(TensorDataset(data), batch_size=batch_size, sampler=RankSampler(n, rank, world))


class TinyTransformer(pl.LightningModule):
    """A one-layer transformer LM with a frozen layer, an unused parameter and an odd parameter count.

    Args:
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum), both with two param groups.
        record_grad_norm: record the strategy's global gradient norm at every optimizer step.
    """

    def __init__(self, optimizer: str = "adamw", record_grad_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 12)
        self.enc = nn.TransformerEncoderLayer(12, 2, 24, dropout=0.0, batch_first=True)
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)  # never used in forward
        self.head = nn.Linear(12, VOCAB)  # 12*17 + 17: the total is odd
        self.optimizer_name = optimizer
        self.record_grad_norm = record_grad_norm
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        h = self.enc(self.frozen(self.emb(x[:, :-1])))
        loss = nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        boundary = (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0
        if self.record_grad_norm and boundary and engine is not None and engine.last_grad_norm is not None:
            self.grad_norms.append(engine.last_grad_norm)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        names = dict(self.named_parameters())
        decay = [p for n, p in names.items() if p.dim() >= 2 and not n.startswith("unused")]
        no_decay = [p for n, p in names.items() if p.dim() < 2 or n.startswith("unused")]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD([{"params": decay}, {"params": no_decay, "lr": 0.05}], lr=0.1, momentum=0.9)
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
        )


def make_trainer(strategy: Any, devices: int = 2, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer for tests (no logger, checkpoints, progress bar or summary)."""
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # keep RankSampler's fixed order (Lightning would wrap and shuffle it)
    )
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)


def params_of(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


class ManualOptimization:
    """Mixin for a LightningModule: its ``training_step`` loss trained with manual optimization
    (``manual_backward``, explicit norm clipping at 0.05; :meth:`after_clip` runs before the step).
    The module sets ``automatic_optimization = False``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()  # type: ignore[attr-defined]
        loss = super().training_step(batch, batch_idx)  # type: ignore[misc]
        opt.zero_grad()
        self.manual_backward(loss)  # type: ignore[attr-defined]
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")  # type: ignore[attr-defined]
        self.after_clip()
        opt.step()
        return loss

    def after_clip(self) -> None:
        """Called between clipping and the optimizer step."""


class ManualTinyTransformer(ManualOptimization, TinyTransformer):
    """The same model trained with manual optimization (``manual_backward``, explicit clipping)."""

    def __init__(self, optimizer: str = "adamw", record_grad_norm: bool = False) -> None:
        super().__init__(optimizer, record_grad_norm)
        self.automatic_optimization = False


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class StackedLM(pl.LightningModule):
    """Blocks in an ``nn.ModuleList`` (stage 3's units) between an embedding tied to the output head.

    Block 1 is frozen (a frozen unit); each block has 687 parameters (odd: not divisible by the
    world size) and the largest parameter has 312 elements.
    """

    def __init__(self, optimizer: str = "adamw", num_blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 13)
        self.blocks = nn.ModuleList(_Block(13, 24) for _ in range(num_blocks))
        self.blocks[1].requires_grad_(False)
        self.norm = nn.LayerNorm(13)
        self.head = nn.Linear(13, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.optimizer_name = optimizer
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def _loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        return nn.functional.cross_entropy(self(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True, batch_size=len(batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD([{"params": decay}, {"params": no_decay, "lr": 0.05}], lr=0.1, momentum=0.9)
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
        )


# stage 3 that really shards TinyTransformer (every parameter below the default persistence
# threshold of 100k): no persistent unit, the encoder and each Linear a unit, no prefetch
STAGE3_SHARDED: dict[str, Any] = dict(param_persistence_threshold=0, prefetch_bucket_size=1,
                                      unit_classes=(nn.TransformerEncoderLayer, nn.Linear))


def units_released(strategy: Any, model: nn.Module) -> dict[str, Any]:
    """What a stage-3 fit's runtime saw: the most parameter elements gathered at once (a peak
    over training) against the model's total, and how many units were released at least once."""
    runtime = strategy._run.last_runtime
    return {"peak_live": runtime.peak_live_numel, "total": sum(p.numel() for p in model.parameters()),
            "released_units": sum(u.releases > 0 for u in runtime.units if not u.persistent),
            "persistent": sum(u.numel for u in runtime.units if u.persistent)}


def assert_released(info: dict[str, Any]) -> None:
    assert info["persistent"] == 0 and info["released_units"] >= 2, info
    assert 0 < info["peak_live"] < info["total"], info
