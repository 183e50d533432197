"""Train a tiny GPT with 1-bit Adam (ZeRO stage 0) on 2 CPU processes: python docs/examples/onebit_adam.py [steps]

Prints, on rank 0, the bytes each optimizer step sent and the compression ratio once the warm-up is over.
"""

import sys

import lightning.pytorch as pl
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule

from lightning_zero import OneBitAdam, ZeroStrategy


class PrintTraffic(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = trainer.strategy.engine.comm.bytes_sent

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        sent = trainer.strategy.engine.comm.bytes_sent - self.before
        if trainer.is_global_zero and trainer.global_step % 5 == 0:
            ratio = opt.last_compression_ratio
            print(f"step {trainer.global_step:3d}: {sent:7d} bytes sent, "
                  f"{'warm-up (AdamW)' if ratio is None else f'compressed {ratio:.1f}x'}")


class OneBitGPT(GPTLightningModule):  # any LightningModule
    def configure_optimizers(self):
        return OneBitAdam(self.parameters(), lr=3e-3, freeze_step=10, betas=(0.9, 0.999), weight_decay=0.01)


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=0), gradient_clip_val=1.0,
                         max_steps=steps, callbacks=[PrintTraffic()], **quiet)
    data = TextDataModule(seq_len=64, micro_batch_size=8, max_bytes=1_000_000)
    trainer.fit(OneBitGPT("gpt_tiny"), data)
