"""A GPT built on the meta device under ZeRO stage 3, weights streamed in from a .safetensors file,
activation checkpointing on, and one rank editing a weight with gathered_parameters.

Run: python docs/examples/large_model.py   (2 CPU processes)
"""

import os
import tempfile

import lightning.pytorch as pl
import torch
from experiments.data import TextDataModule
from experiments.gpt import GPTLightningModule
from safetensors.torch import save_file

from lightning_zero import ZeroStrategy, gathered_parameters

WEIGHTS = os.path.join(tempfile.gettempdir(), "lightning_zero_gpt_tiny.safetensors")


class LoadAndEdit(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.load_full_state_dict(WEIGHTS)  # one unit at a time, into the shards
        block, head = pl_module.model.blocks[0], pl_module.model.ln_f.weight
        with gathered_parameters(block.parameters()):  # read, on every rank
            norm = float(block.attn.qkv.weight.norm())
        with gathered_parameters(head, modifier_rank=0):  # rank 0 changes it, every rank gets it
            if trainer.global_rank == 0:
                with torch.no_grad():
                    head.mul_(1.0)
        if trainer.is_global_zero:
            s = trainer.strategy
            print(f"block 0's qkv weight norm {norm:.4f}; model-state bytes on rank 0 after loading:",
                  s.model_state_bytes())


if __name__ == "__main__":
    if not os.path.exists(WEIGHTS):  # "pretrained" weights: a whole model saved once
        torch.manual_seed(0)
        whole = GPTLightningModule("gpt_tiny")
        save_file({k: v.contiguous() for k, v in whole.state_dict().items() if "lm_head" not in k}, WEIGHTS)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=3, param_persistence_threshold=0, activation_checkpointing=True),
        max_steps=10,
        callbacks=[LoadAndEdit()],
        logger=False,
        enable_checkpointing=False,
    )
    module = GPTLightningModule("gpt_tiny", build_in_configure_model=True)  # built on meta, sharded at setup
    trainer.fit(module, TextDataModule(seq_len=64, micro_batch_size=4, max_bytes=1_000_000))
