"""The project's own training script, plain Lightning DDP (what it ran before lightning_zero):
``python train_plain.py`` (2 CPU processes). The CLI runs the same objects from conf/ (README.md)."""

from __future__ import annotations

import functools
from wave.data import WaveData
from wave.model import WaveNet

import lightning.pytorch as pl
import torch


def main(root_dir: str = ".", max_steps: int = 3, seed: int = 7, strategy: str = "ddp", devices: int = 2) -> WaveNet:
    pl.seed_everything(seed)
    model = WaveNet(width=40, depth=2, dropout=0.1, optimizer=functools.partial(torch.optim.Adam, lr=0.01),
                    scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5))
    data = WaveData(num_samples=256, batch_size=16, seed=3)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps,
                         default_root_dir=root_dir, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, data)
    return model


if __name__ == "__main__":
    main()
