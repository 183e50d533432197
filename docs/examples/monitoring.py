"""ZeRO stage 2 in fp16 on 2 CPU processes, watched by the ZeroStatsMonitor dashboard (on by default):

    python docs/examples/monitoring.py              # 120 steps (default), logs in runs/monitoring/
    python docs/examples/monitoring.py 40           # fewer steps
    tensorboard --logdir runs/monitoring            # losses first; CUSTOM SCALARS: the dashboard

The loss scale starts at 2**16 and doubles after every 40 clean steps (a short window, to show it
move); an overflow spends a hysteresis credit, the next one halves it. Steps 10-11 are profiled
(`runs/monitoring/profiler/rank<r>.*.pt.trace.json`, memory included).
"""

import sys

import lightning.pytorch as pl
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule

from lightning_zero import LossScalerConfig, ProfilerWindow, ZeroPrecision, ZeroStrategy, ZeroTensorBoardLogger

if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    scaler = LossScalerConfig(initial_scale_power=16, loss_scale_window=40, hysteresis=2)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, precision=ZeroPrecision("16-mixed", loss_scaler=scaler),
                              profiler=ProfilerWindow(wait=9, warmup=1, active=2)),
        max_steps=steps,
        accumulate_grad_batches=2,  # train/loss is the mean over both micro-batches of both ranks
        gradient_clip_val=1.0,
        log_every_n_steps=1,
        logger=ZeroTensorBoardLogger("runs", name="monitoring", version=""),  # the dashboard (docs/monitoring.md)
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = TextDataModule(seq_len=32, micro_batch_size=8, max_bytes=200_000, deterministic_order=True)
    trainer.fit(GPTLightningModule("gpt_tiny"), data)
