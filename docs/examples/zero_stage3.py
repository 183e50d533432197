"""Train a tiny GPT with ZeRO stage 3 on 2 CPU processes: python docs/examples/zero_stage3.py

Prints, on rank 0, the model state kept between steps (16Ψ/N for fp32 + AdamW), the most parameter
elements that were ever gathered at once, and the bound the prefetch settings allow.
"""

import lightning.pytorch as pl
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule

from lightning_zero import ZeroStrategy


class PrintStage3(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0 and trainer.is_global_zero:
            print("model-state bytes on rank 0:", trainer.strategy.model_state_bytes())

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            s = trainer.strategy
            print(f"gathered at most {s.gathered_peak_numel:,} elements (bound {s.gathered_bound_numel:,})")


if __name__ == "__main__":
    strategy = ZeroStrategy(
        stage=3,
        prefetch_bucket_size=30_000,  # elements gathered ahead of the running block
        param_persistence_threshold=0,  # shard every parameter (DeepSpeed's default keeps < 1e5 whole)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=20,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        limit_val_batches=4,
        val_check_interval=10,
        callbacks=[PrintStage3()],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(GPTLightningModule("gpt_tiny"), TextDataModule(seq_len=64, micro_batch_size=4, max_bytes=1_000_000))
