"""Sharded checkpoints: save during fit, resume at another world size / stage, export one file.

Run: python docs/examples/sharded_checkpoint.py   (CPU, about a minute; writes ./sharded_example/)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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


QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
LAUNCHER = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
            "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")  # what a launcher set for this process's ranks


def first_run(root: str) -> None:
    """2 ranks at stage 2: every rank writes only its own shards."""
    saver = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_last=True)
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=2), devices=2, callbacks=[saver], max_steps=8, **QUIET)
    trainer.fit(LM(), data())  # root/last.ckpt -> root/last.ckpt.v2/
    if trainer.global_rank == 0:
        print(sorted(os.listdir(root)))  # last.ckpt -> last.ckpt.v2, epoch=1-step=8.ckpt -> ....v1
        fresh = {k: v for k, v in os.environ.items() if k not in LAUNCHER}  # a process of its own, not a rank
        subprocess.run([sys.executable, __file__, "resume"], check=True, env=fresh)


def resume(root: str) -> None:
    """A fresh process: 1 rank at stage 3 from the 2-rank stage-2 checkpoint, then one plain file."""
    saver = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_last=True)
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=3), devices=1, callbacks=[saver], max_steps=12, **QUIET)
    trainer.fit(LM(), data(), ckpt_path="last")  # resume: any world size, any stage
    state = consolidate_checkpoint(os.path.join(root, "last.ckpt"))  # fp32 state_dict, no process group
    LM().load_state_dict(state, strict=True)
    convert_checkpoint(os.path.join(root, "last.ckpt"), os.path.join(root, "lm.ckpt"), lightning=True)
    print(LM.load_from_checkpoint(os.path.join(root, "lm.ckpt"), weights_only=True).hparams)


if __name__ == "__main__":
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    root = os.path.abspath("sharded_example")  # the working directory: the same for every rank
    if sys.argv[1:] == ["resume"]:
        resume(root)
    else:
        if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:  # before any rank saves
            shutil.rmtree(root, ignore_errors=True)
        first_run(root)
