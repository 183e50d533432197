"""Writes ``tests/data/checkpoint_format1_stage2`` and its ``.expected.safetensors`` with the code on PYTHONPATH.

The committed files were written by commit c909405 (before the metadata records of
``checkpoint/layout.py``): ``PYTHONPATH=<that tree> python tests/data/write_format1_checkpoint.py OUT``
(TinyTransformer with AdamW, ZeroStrategy stage 2 on two CPU ranks, saved after step 2). The expected
file holds what that code read back: the consolidated state dict (``sd.<key>``) and the optimizer's
per-parameter state (``opt.<index>.<key>``).
"""

import os
import sys

import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import save_file

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import ShardedCheckpoint, consolidate_checkpoint, materialize_optimizer_state
from tests.models import TinyTransformer, make_trainer, token_loader


class SaveAtStepTwo(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == 2:
            trainer.save_checkpoint(self.path)


def main(out: str) -> None:
    path = os.path.join(out, "checkpoint")
    trainer = make_trainer(ZeroStrategy(stage=2), devices=2, max_steps=3, callbacks=[SaveAtStepTwo(path)])
    trainer.fit(TinyTransformer("adamw"), token_loader(n=48, batch_size=4))
    if trainer.global_rank == 0:
        expected = {f"sd.{k}": v.contiguous() for k, v in consolidate_checkpoint(path).items()}
        optimizer = materialize_optimizer_state(ShardedCheckpoint(path).optimizer_states()[0])
        for index, state in optimizer["state"].items():
            expected.update({f"opt.{index}.{k}": torch.as_tensor(v).contiguous() for k, v in state.items()})
        save_file(expected, os.path.join(out, "expected.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
