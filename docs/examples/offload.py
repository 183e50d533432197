"""Train a tiny GPT on 2 CPU processes with its optimizer state (stage 2) or its optimizer state and parameter
shards (stage 3) in swap files on disk: python docs/examples/offload.py 3"""

import sys
import tempfile

import lightning.pytorch as pl

from experiments import GPTLightningModule, TextDataModule
from lightning_zero import ZeroStrategy


class PrintOffload(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        store = trainer.strategy.engine.sharded.offload
        if trainer.is_global_zero and batch_idx % 3 == 2:
            c = store.counters
            line = f"step {c.steps}: optimizer state read {c.bytes_read >> 10} KiB, wrote {c.bytes_written >> 10} KiB"
            if store.params is not None:  # offload_param: the parameter shards' traffic
                p = store.params.counters
                line += f"; parameter shards in {p.bytes_in >> 10} KiB, out {p.bytes_out >> 10} KiB"
            print(line)


if __name__ == "__main__":
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as disk:  # any existing, writable directory on a local disk
        if stage == 3:  # ZeRO-Infinity: parameter shards too (every unit sharded: no persistent parameters)
            strategy = ZeroStrategy(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=disk,
                                    param_persistence_threshold=0)
        else:  # or offload_optimizer="cpu": separate host memory
            strategy = ZeroStrategy(stage=stage, offload_optimizer="nvme", nvme_path=disk)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, gradient_clip_val=1.0,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             callbacks=[PrintOffload()])
        trainer.fit(GPTLightningModule("gpt_tiny"), TextDataModule(seq_len=64, micro_batch_size=4, max_bytes=200_000))
