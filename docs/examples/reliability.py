"""Non-finite gradients skipped, hung ranks watched, exact determinism, on 2 CPU processes:
python docs/examples/reliability.py [skip|raise|diverge]

Step 3 gets a nan gradient on rank 1. With ``nonfinite="skip"`` the step is skipped on both ranks and
counted; with ``"raise"`` both ranks stop, naming the step and the first parameter with a nan gradient.
``hang_timeout_s=20``: a rank silent for 20 s would be named by the other, which would then exit.

``diverge``: at step 3 rank 1 calls an ``all_reduce`` of its own from ``training_step`` that rank 0 never
calls (a collective under ``if rank == ...``). Both ranks stay alive, each waiting for the other in a
different collective; after ``hang_timeout_s=10`` s without progress both print the same finding (rank 1
behind, in user code; rank 0 waiting in the strategy's gradient all-reduce) and exit with code 76.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy


class Regression(pl.LightningModule):
    def __init__(self, fault: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.fault = fault
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x), y)
        if self.trainer.global_step == 3 and self.global_rank == 1:
            if self.fault == "diverge":
                dist.all_reduce(torch.ones(1))  # a collective on one rank only: the bug the watchdog names
            else:
                loss = loss * float("nan")  # a bad batch on one rank
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "skip"
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    if mode == "diverge":
        strategy = ZeroStrategy(stage=2, hang_timeout_s=10)
    else:
        strategy = ZeroStrategy(stage=2, nonfinite=mode, hang_timeout_s=20)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Regression(mode)
    trainer.fit(model, DataLoader(data, batch_size=16))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"rank {trainer.global_rank}: {trainer.global_step} steps, skipped {strategy.nonfinite_skipped_steps} "
          f"non-finite step(s), weights finite: {finite}", flush=True)  # one write: the ranks' lines stay apart
