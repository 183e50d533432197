"""Train a tiny GPT from a DeepSpeed JSON config on 2 CPU processes: python docs/examples/deepspeed_json.py

The JSON gives ZeRO stage 2, the batch (16 = 4 per rank x 2 accumulation steps x 2 ranks), gradient
clipping, AdamW and a WarmupDecayLR schedule; the module leaves its optimizer to the JSON.
"""

from pathlib import Path

import lightning.pytorch as pl
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule

from lightning_zero import DeepSpeedZeroStrategy


class TinyLM(GPTLightningModule):
    def configure_optimizers(self):
        return None  # the DeepSpeed config's optimizer and scheduler are used


if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)  # the same run, and the same printed loss, every time
    strategy = DeepSpeedZeroStrategy.from_deepspeed_config(Path(__file__).with_name("ds_config.json"))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=20, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyLM("gpt_tiny"), TextDataModule(seq_len=64, micro_batch_size=4, max_bytes=1_000_000))
    if trainer.is_global_zero:
        print(f"accumulate_grad_batches={trainer.accumulate_grad_batches} gradient_clip_val="
              f"{trainer.gradient_clip_val} optimizer={type(trainer.optimizers[0]).__name__} "
              f"final train_loss={float(trainer.callback_metrics['train_loss']):.3f}")
