"""Lightning glue of the hang watchdog: start it per rank at setup, mark the running operation, and
end the process with a message naming the silent rank(s) (Note [hang watchdog] in core/heartbeat.py).

``ZeroStrategy`` adds a :class:`HangWatchdog` callback at setup when the process group has more
than one rank and ``hang_timeout_s > 0``. A surviving rank that finds a silent one prints the report
to stderr and leaves with exit code :data:`HANG_EXIT_CODE` (``os._exit``: its main thread is blocked
inside a collective that only the silent rank could complete). Under torchrun that ends the job:
the agent stops the other ranks once one exits non-zero.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from typing_extensions import override

from lightning_zero.core.heartbeat import HangReport, HeartbeatWatchdog, interval_for

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: the job may well succeed when restarted without the hung host
_generation = [0]  # watchdogs started in this process; every rank starts them in the same order


def _exit_with(report: HangReport, linger_s: float = 0.0) -> None:
    print(report.message(), file=sys.stderr, flush=True)
    time.sleep(linger_s)  # the others read the published report (this process may host the store)
    os._exit(HANG_EXIT_CODE)


def _side_channel(timeout_s: float) -> dist.Store:
    """The process group's store; a TCPStore gets a connection of its own, so the watchdog never
    waits behind a store call of the main thread (e.g. a rendezvous) and has its own timeout."""
    store = dist.distributed_c10d._get_default_store()
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    return store


def _marks(operation: str) -> Callable[..., None]:
    """A :class:`HangWatchdog` hook (any Lightning callback hook's arguments) marking ``operation``."""

    def hook(self: HangWatchdog, trainer: pl.Trainer, *args: Any) -> None:
        self.mark(operation, trainer)

    hook.__doc__ = f"Mark {operation!r} as this rank's running operation."
    return hook


class HangWatchdog(pl.Callback):
    """Runs a :class:`~lightning_zero.core.heartbeat.HeartbeatWatchdog` for the Trainer's run.

    Args:
        timeout_s: seconds of silence after which a rank is named (``zero.hang_timeout_s``).
        on_hang: what to do with the report (default: print it and end the process).
    """

    def __init__(self, timeout_s: float, on_hang: Callable[[HangReport], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_hang = on_hang or (lambda report: _exit_with(report, 2 * interval_for(timeout_s) + 0.5))
        self.watchdog: HeartbeatWatchdog | None = None

    def start(self, rank: int, world_size: int) -> None:
        """Start beating (every rank of the run must start one: ``ZeroStrategy.setup`` does)."""
        self.stop()
        _generation[0] += 1
        self.watchdog = HeartbeatWatchdog(
            _side_channel(self.timeout_s), rank, world_size, self.timeout_s, self.on_hang,
            prefix=f"lightning_zero/heartbeat/{_generation[0]}",
        ).start()

    def stop(self) -> None:
        """Stop beating and tell the other ranks this one is done (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def mark(self, operation: str, trainer: pl.Trainer) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(operation, trainer.global_step)

    # Lightning hook -> the operation a rank silent after it is named as running
    on_train_batch_start = _marks("training_step")
    on_before_backward = _marks("backward (gradient reduction)")
    on_before_optimizer_step = _marks("optimizer step (parameter all-gather)")
    on_train_batch_end = _marks("between steps (callbacks, logging, checkpointing)")
    on_save_checkpoint = _marks("checkpoint save")
    on_validation_batch_start = _marks("validation step")

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any) -> None:
        self.stop()


def add_hang_watchdog(trainer: pl.Trainer, timeout_s: float) -> HangWatchdog | None:
    """``ZeroStrategy.setup``: start this rank's watchdog (one callback per Trainer), or ``None``
    when disabled (``timeout_s == 0``) or the run has one rank."""
    if not timeout_s or not (dist.is_available() and dist.is_initialized()) or trainer.world_size == 1:
        return None
    found = [c for c in trainer.callbacks if isinstance(c, HangWatchdog)]
    callback = found[0] if found else HangWatchdog(timeout_s)
    if not found:
        trainer.callbacks.append(callback)
    callback.start(trainer.global_rank, trainer.world_size)
    return callback
