"""Run under ``torch.distributed.run`` (2 ranks) by tests/e2e/test_checkpoints.py: saves ``last.ckpt`` at
step 2, then rank 1 SIGKILLs itself in the middle of the step-4 save."""

from __future__ import annotations

import sys

from lightning.pytorch.callbacks import Callback

from lightning_zero import ZeroStrategy
from tests.e2e.test_checkpoints import _FaultAfter, _fit, _saver
from tests.models import TinyTransformer


class _Report(Callback):
    def on_train_batch_end(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == 2 and trainer.is_global_zero:
            print("SAVED step 2", flush=True)


if __name__ == "__main__":
    _fit(TinyTransformer("sgd"), ZeroStrategy(stage=2, timeout_s=60), max_steps=4,
         callbacks=[_saver(sys.argv[1], every=2, save_last=True), _Report(), _FaultAfter(3, 1, "kill")])
