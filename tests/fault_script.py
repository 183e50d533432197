"""One rank of a fault-injection run for tests/e2e/test_hang_watchdog.py:
``python tests/fault_script.py MODE ROOT`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (and
LOCAL_RANK, NODE_RANK) set, by torchrun or by the test itself. It joins the gloo group first (so the
data is split by rank exactly as in the test pool), then fits TinyTransformer under ZeroStrategy:

- ``stop``: rank 1 SIGSTOPs itself at step 3 (the others must name it and exit);
- ``kill``: saves ``last.ckpt`` every 2 steps into ROOT, rank 1 SIGKILLs itself at step 5;
- ``slowsave``: rank 0's first checkpoint write (at step 2) takes ``SLOW_SAVE_S`` seconds more while rank 1
  waits in the save's barrier (must not trip the watchdog); the later writes (``last.ckpt``, step 4) are not
  slowed: each would wait the same way and add only its ``SLOW_SAVE_S`` to the suite's time;
- ``diverge``: rank 1 calls an extra ``all_reduce`` from ``training_step`` at step 3 that rank 0 never
  calls (every rank must name rank 1 and the collectives each side waits in, then exit);
- ``launch_stop``: run without RANK / WORLD_SIZE: ``Trainer(devices=2)``'s own launcher (Lightning's: this
  script re-run for rank 1, a child of rank 0) starts the ranks; rank ``STOP_RANK`` SIGSTOPs itself at step 3.

``HANG_TIMEOUT_S`` sets ``hang_timeout_s`` (unset: the library's default); the collective timeout is 120 s,
far above it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_zero import ZeroStrategy
from lightning_zero.core.reliability.progress_record import parse_progress
from tests.e2e.test_checkpoints import _fit, _saver
from tests.models import TinyTransformer


class Fault(Callback):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        rank, step = trainer.global_rank, trainer.global_step
        if self.mode == "stop" and rank == 1 and step == 3:
            print(f"STOPPING rank 1 at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.mode == "launch_stop" and rank == int(os.environ["STOP_RANK"]) and step == 3:
            time.sleep(2.0)  # a long step first: every watchdog has run rounds (3 steps take less than one)
            print(f"STOPPING rank {rank} pid {os.getpid()} at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.mode == "kill" and rank == 1 and step == 5:
            print(f"KILLING rank 1 at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def setup(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if self.mode == "launch_stop":
            print(f"RANK {trainer.global_rank} pid {os.getpid()}", flush=True)
        if self.mode == "slowsave" and trainer.global_rank == 0:  # a slow file system: rank 0's write takes long
            strategy, save, slowed = trainer.strategy, trainer.strategy.save_checkpoint, []

            def slow_save(*a: Any, **kw: Any) -> None:
                save(*a, **kw)
                if slowed:
                    return
                slowed.append(trainer.global_step)
                time.sleep(float(os.environ["SLOW_SAVE_S"]))
                seen = parse_progress(strategy._hang.watchdog._seen.get(1, ""))  # rank 0 aggregates the beats
                print(f"SLOW SAVE done at step {trainer.global_step}; rank 1 {seen.where() if seen else None}",
                      flush=True)

            strategy.save_checkpoint = slow_save


class Diverging(TinyTransformer):
    """Rank 1 issues a collective of its own at step 3 (on the default group; the strategy's are on its own)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.trainer.global_step == 3:
            print(f"EXTRA all_reduce on rank 1 at step 3 t={time.monotonic():.3f}", flush=True)
            dist.all_reduce(torch.ones(1))
        return loss


def main(mode: str, root: str) -> None:
    if mode != "launch_stop":  # else Lightning's launcher starts the ranks and their group
        dist.init_process_group("gloo")
    # no HANG_TIMEOUT_S: the library's default hang_timeout_s (what the SIGSTOP test checks)
    hang = {"hang_timeout_s": float(os.environ["HANG_TIMEOUT_S"])} if "HANG_TIMEOUT_S" in os.environ else {}
    strategy = ZeroStrategy(stage=2, timeout_s=120, **hang)
    steps = {"stop": 200, "kill": 8, "slowsave": 4, "diverge": 200, "launch_stop": 200}[mode]
    callbacks = [Fault(mode)] + ([_saver(root, every=2, save_last=True)] if mode in ("kill", "slowsave") else [])
    model = Diverging("adamw") if mode == "diverge" else TinyTransformer("adamw")
    _fit(model, strategy, devices=2 if mode == "launch_stop" else dist.get_world_size(), max_steps=steps,
         callbacks=callbacks)
    print(f"DONE rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from lightning_zero.config.run.worker import exit_after_handlers

    main(sys.argv[1], sys.argv[2])
    exit_after_handlers(0)  # as the CLI's ranks do: without ~2 s of interpreter teardown
