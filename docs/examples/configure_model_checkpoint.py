"""A model built in configure_model under ZeRO stage 3, with a torchmetrics metric and a buffer:
fit, save, resume with a new Trainer, then test and predict from the checkpoint (each run shards
the model and gathers one block at a time).

Run: python docs/examples/configure_model_checkpoint.py   (2 CPU processes)
"""

import os
import tempfile

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import Accuracy

from lightning_zero import ZeroStrategy

CKPT = os.path.join(tempfile.gettempdir(), "lightning_zero_configure_model.ckpt")


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is not None:  # idempotent: Lightning may call it again
            return
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ModuleList([nn.Linear(64, 64) for _ in range(4)]))
        self.head = nn.Linear(64, 2)
        self.register_buffer("scale", torch.full((64,), 0.5))  # a real buffer, whole on every rank
        self.acc = Accuracy(task="multiclass", num_classes=2)  # real metric states

    def forward(self, x):
        h = self.net[0](x) * self.scale
        for block in self.net[1]:
            h = torch.tanh(block(h))
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.acc(self(x), y)
        self.log("test_acc", self.acc)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def trainer(**kw):
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0)  # every parameter sharded
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, **kw)


if __name__ == "__main__":
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    first = trainer(max_epochs=1)
    first.fit(Classifier(), data)
    first.save_checkpoint(CKPT)  # a sharded checkpoint directory
    trainer(max_epochs=3).fit(Classifier(), data, ckpt_path=CKPT)  # resumes at epoch 1
    trainer().test(Classifier(), data, ckpt_path=CKPT)
    predictions = trainer().predict(Classifier(), data, ckpt_path=CKPT)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print("predicted classes of the first batch:", predictions[0].tolist())
