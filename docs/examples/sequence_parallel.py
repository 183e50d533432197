"""docs/sequence_parallel.md's example: the tiny GPT trained with each sequence split over 2 ranks
(DeepSpeed-Ulysses) at ZeRO stage 3, on CPU / gloo; ``python docs/examples/sequence_parallel.py 1`` runs the
same fit unsplit on 1 rank, with the same losses (tests/e2e/test_sequence_parallel.py checks them to 1e-5)."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from lightning_zero.models.gpt import GPTLightningModule


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        self.losses.append(float(outputs["loss"]))


def fit(devices: int, sequence_parallel: int) -> list[float]:
    torch.manual_seed(0)
    module = GPTLightningModule("gpt_tiny", lr=0.05, optimizer="sgd", warmup_steps=0)  # 4 heads, 64 tokens
    tokens = torch.randint(0, 256, (32, 65), generator=torch.Generator().manual_seed(1))
    loader = DataLoader([(row[:-1], row[1:]) for row in tokens], batch_size=4)
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                         strategy=ZeroStrategy(stage=3, sequence_parallel=sequence_parallel))
    trainer.fit(module, loader)  # both ranks of the sequence group draw the same samples; each takes 32 tokens
    return losses.losses


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    losses = fit(devices=size, sequence_parallel=size)
    if pl.utilities.rank_zero.rank_zero_only.rank == 0:
        print(" ".join(f"{loss:.5f}" for loss in losses))
