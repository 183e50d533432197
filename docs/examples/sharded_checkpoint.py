"""Sharded checkpoints: save during fit, resume at another world size / stage, export one file.

Run: python docs/examples/sharded_checkpoint.py   (CPU, about a minute)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import consolidate_checkpoint, convert_checkpoint


class LM(pl.LightningModule):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (x,) = batch
        return nn.functional.cross_entropy(self(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(0))),
                      batch_size=8)


def trainer(stage: int, devices: int, max_steps: int, root: str) -> pl.Trainer:
    saver = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_last=True)
    return pl.Trainer(strategy=ZeroStrategy(stage=stage), accelerator="cpu", devices=devices, max_steps=max_steps,
                      callbacks=[saver], logger=False, enable_progress_bar=False, enable_model_summary=False)


if __name__ == "__main__":
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    root = os.path.join(tempfile.gettempdir(), "lightning_zero_sharded_example")  # the same on every rank
    if sys.argv[1:] == ["resume"]:  # a fresh process: 1 rank, stage 3, from the 2-rank stage-2 checkpoint
        trainer(stage=3, devices=1, max_steps=12, root=root).fit(LM(), data(), ckpt_path="last")
        state = consolidate_checkpoint(os.path.join(root, "last.ckpt"))  # no process group needed
        LM().load_state_dict(state, strict=True)
        convert_checkpoint(os.path.join(root, "last.ckpt"), os.path.join(root, "lm.ckpt"), lightning=True)
        print(LM.load_from_checkpoint(os.path.join(root, "lm.ckpt"), weights_only=True).hparams)
        sys.exit(0)
    if "LOCAL_RANK" not in os.environ:  # the launching process (Lightning starts rank 1 with LOCAL_RANK=1)
        shutil.rmtree(root, ignore_errors=True)
    trainer(stage=2, devices=2, max_steps=8, root=root).fit(LM(), data())  # 2 ranks write their shards
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(sorted(os.listdir(root)))  # last.ckpt -> last.ckpt.v2, epoch=1-step=8.ckpt -> ....v1
        subprocess.run([sys.executable, __file__, "resume"], check=True)
