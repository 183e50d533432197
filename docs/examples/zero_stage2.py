"""Train a tiny GPT with ZeRO stage 2 on 2 CPU processes: python docs/examples/zero_stage2.py"""

import lightning.pytorch as pl
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule

import lightning_zero  # noqa: F401  (registers the zero_stage_* strategy names)
from lightning_zero import ZeroStrategy


class PrintModelState(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0 and trainer.is_global_zero:
            print("model-state bytes on rank 0:", trainer.strategy.model_state_bytes())


if __name__ == "__main__":
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, reduce_bucket_size=1_000_000),
        max_steps=20,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        callbacks=[PrintModelState()],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(GPTLightningModule("gpt_tiny"), TextDataModule(seq_len=64, micro_batch_size=4, max_bytes=1_000_000))
