"""A tiny GPT in 2 pipeline stages (1F1B, 4 micro-batches) with ZeRO stage 2 on 2 CPU processes.

The GPT is built in ``configure_model``: on the meta device, and each rank materialises only its
stage's layers (with GPT's own initialisation), so no rank ever holds the whole model.

Run: python docs/examples/pipeline.py
"""

import lightning.pytorch as pl
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule

from lightning_zero import PipelineConfig, ZeroStrategy
from lightning_zero.models.gpt import gpt_param_init


class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the batch-mean loss of the last stage, known on every rank
        if batch_idx % 5 == 0:  # flushed: one write per line, so the two ranks' lines do not run together
            loss = float(outputs["loss"])
            print(f"rank {trainer.global_rank} step {trainer.global_step}: loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    pipeline = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="parameters")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,  # 2 stages x 1 data-parallel rank; devices=4 gives 2 x 2
        strategy=ZeroStrategy(stage=2, pipeline=pipeline, param_init_fn=gpt_param_init("gpt_tiny")),
        max_steps=20,
        gradient_clip_val=1.0,
        limit_val_batches=2,
        val_check_interval=10,
        callbacks=[PrintLoss()],
        enable_progress_bar=False,  # PrintLoss prints the losses (the bar, max_steps without epochs: "Epoch 0/-2")
        logger=False,
        enable_checkpointing=False,
    )
    model = GPTLightningModule("gpt_tiny", warmup_steps=0, build_in_configure_model=True)
    trainer.fit(model, TextDataModule(seq_len=64, micro_batch_size=8, max_bytes=400_000, max_val_samples=16))
    print(f"rank {trainer.global_rank}: val_loss {float(trainer.callback_metrics['val_loss']):.4f}", flush=True)
