"""ZeRO stage 2 in fp32, fp16, bf16 or pure bf16 on 2 CPU processes:

    python docs/examples/mixed_precision.py 16-mixed       # or 32-true, bf16-mixed, bf16-true
    python docs/examples/mixed_precision.py bf16-true 200  # more steps (default 40)
    python docs/examples/mixed_precision.py all 200        # the four modes in turn (docs/precision.md's table)
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


def run(mode: str, steps: int) -> None:
    # fp16 only: DeepSpeed's dynamic loss scaler (these are its defaults, except a shorter window)
    fp16 = mode == "16-mixed"
    scaler = LossScalerConfig(initial_scale_power=16, loss_scale_window=100, hysteresis=2) if fp16 else None
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, precision=ZeroPrecision(mode, loss_scaler=scaler)),
        max_steps=steps,
        gradient_clip_val=1.0,  # clipped by the global norm of the unscaled fp32 gradients
        callbacks=[ZeroStatsMonitor(prog_bar=True), Report()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=25,
    )
    data = TextDataModule(seq_len=32, micro_batch_size=8, max_bytes=200_000, deterministic_order=True)
    model = GPTLightningModule("gpt_tiny")
    trainer.fit(model, data)
    val = trainer.validate(model, data, verbose=False)[0]["val_loss"]  # runs in the same precision
    if trainer.is_global_zero:
        print(f"{mode}: val_loss={val:.4f} after {steps} steps")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "16-mixed"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    for each in ("32-true", "16-mixed", "bf16-mixed", "bf16-true") if mode == "all" else (mode,):
        run(each, steps)
