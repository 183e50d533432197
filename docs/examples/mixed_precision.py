"""ZeRO stage 2 in fp32, fp16, bf16 or pure bf16 on 2 CPU processes:

    python docs/examples/mixed_precision.py 16-mixed     # or 32-true, bf16-mixed, bf16-true
"""

import sys

import lightning.pytorch as pl

from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule
from lightning_zero import LossScalerConfig, ZeroPrecision, ZeroStatsMonitor, ZeroStrategy


class Report(pl.Callback):
    """Prints what the precision mode did, on rank 0, before the strategy tears down."""

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        bytes_ = s.model_state_bytes()
        if trainer.is_global_zero:
            print(f"{s.precision_plugin.precision}: train_loss={float(trainer.callback_metrics['train_loss']):.4f} "
                  f"loss_scale={s.loss_scale} skipped_steps={s.skipped_steps} grad_norm={s.last_grad_norm} "
                  f"params/grads/optimizer bytes={bytes_.params:.0f}/{bytes_.grads:.0f}/{bytes_.optimizer:.0f}")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "16-mixed"
    # fp16 only: DeepSpeed's dynamic loss scaler (these are its defaults, except a shorter window)
    scaler = LossScalerConfig(initial_scale_power=16, loss_scale_window=100, hysteresis=2) if mode == "16-mixed" else None
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, precision=ZeroPrecision(mode, loss_scaler=scaler)),
        max_steps=40,
        gradient_clip_val=1.0,  # clipped by the global norm of the unscaled fp32 gradients
        callbacks=[ZeroStatsMonitor(prog_bar=True), Report()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TextDataModule(seq_len=32, micro_batch_size=8, max_bytes=200_000, deterministic_order=True)
    trainer.fit(GPTLightningModule("gpt_tiny"), data)
