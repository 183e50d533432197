"""Train a tiny GPT with ZeRO stage 2 and the optimizer state on disk: python docs/examples/offload.py"""

import tempfile

import lightning.pytorch as pl
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule

import lightning_zero  # noqa: F401  (registers the zero_stage_* strategy names)
from lightning_zero import OffloadConfig, ZeroStrategy


class PrintOffload(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        store = trainer.strategy.engine.sharded.offload
        if trainer.is_global_zero and batch_idx % 5 == 4:
            c = store.counters
            print(f"step {c.steps}: read {c.bytes_read >> 10} KiB, wrote {c.bytes_written >> 10} KiB from swap files")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as disk:  # any existing, writable directory on a local disk
        offload = OffloadConfig(optimizer_device="nvme", nvme_path=disk, sub_group_size=50_000)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ZeroStrategy(stage=2, offload=offload),  # or ZeroStrategy(stage=2, offload_optimizer="cpu")
            max_steps=10,
            gradient_clip_val=1.0,
            logger=False,
            enable_checkpointing=False,
        )
        trainer.fit(GPTLightningModule("gpt_tiny"), TextDataModule(seq_len=64, micro_batch_size=4, max_bytes=1_000_000))
