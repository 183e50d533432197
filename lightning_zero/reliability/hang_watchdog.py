"""Lightning glue of the hang watchdog: start it per rank at setup, mark the running phase (and which
phases are legitimately long), record Lightning's own collectives, and end the process with the
finding (Note [hang watchdog] in core/reliability/heartbeat.py).

``ZeroStrategy`` adds a :class:`HangWatchdog` callback at setup when the process group has more
than one rank and ``hang_timeout_s > 0``. Every rank prints the same finding to stderr and leaves
with exit code :data:`HANG_EXIT_CODE` (75: a rank is silent) or :data:`STUCK_EXIT_CODE` (76: every
rank alive, none making progress) through ``os._exit``: its main thread is blocked inside a
collective that will not complete. Under torchrun that ends the job: the agent stops the other
ranks once one exits non-zero; a silent rank on the reporting rank's host is ended first (SIGKILL), since
a stopped process does not act on the agent's SIGTERM (Note [ending a silent rank] in
core/reliability/rank_process.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_zero.core.reliability.hang_finding import SILENT_EXIT_CODE, STUCK_EXIT_CODE
from lightning_zero.core.reliability.heartbeat import HangReport, HeartbeatWatchdog, interval_for
from lightning_zero.core.reliability.progress_record import RECORD, ProgressRecord
from lightning_zero.core.reliability.rank_process import end_silent_ranks

HANG_EXIT_CODE = SILENT_EXIT_CODE  # 75, EX_TEMPFAIL: the job may well succeed when restarted without the hung host
__all__ = ["HANG_EXIT_CODE", "STUCK_EXIT_CODE", "HangWatchdog", "RecordedCollectives", "add_hang_watchdog"]
_generation = [0]  # watchdogs started in this process; every rank starts them in the same order


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


def _marks(phase: str, long_phase: bool = False) -> Callable[..., None]:
    """A :class:`HangWatchdog` hook (any Lightning callback hook's arguments) marking ``phase``."""

    def hook(self: HangWatchdog, trainer: pl.Trainer, *args: Any) -> None:
        self.mark(phase, trainer, long_phase)

    hook.__doc__ = f"Mark {phase!r} as this rank's running phase" + (" (long)." if long_phase else ".")
    return hook


class HangWatchdog(pl.Callback):
    """Runs a :class:`~lightning_zero.core.reliability.heartbeat.HeartbeatWatchdog` for the Trainer's run.

    Args:
        timeout_s: seconds of silence, or of no progress, after which ranks are named (``zero.hang_timeout_s``).
        on_hang: what to do with the report (default: print it, let the others print theirs, end the process).
    """

    def __init__(self, timeout_s: float, on_hang: Callable[[HangReport], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_hang = on_hang or self._exit_with
        self.watchdog: HeartbeatWatchdog | None = None
        self._step_started: float | None = None
        self._batches = 0  # training batches ended in this fit

    def _exit_with(self, report: HangReport) -> None:
        print(report.message(), file=sys.stderr, flush=True)
        if self.watchdog is not None and report.kind != "store":
            self.watchdog.settle(2 * interval_for(self.timeout_s) + 0.5)
        # Note [ending a silent rank]: its launcher ends the job now. After the settle: every live rank has its
        # finding printed (a collective with the ended rank then fails at once, which would cut a report short)
        for ended in end_silent_ranks(report.silent):
            print(f"[lightning-zero] rank {report.rank} ended the silent rank {ended.rank} (pid {ended.pid}) with "
                  "SIGKILL: a stopped process does not act on its launcher's SIGTERM.", file=sys.stderr, flush=True)
        os._exit(report.exit_code)

    def start(self, rank: int, world_size: int) -> None:
        """Start beating (every rank of the run must start one: ``ZeroStrategy.setup`` does)."""
        self.stop()
        self._batches, self._step_started = 0, None
        _generation[0] += 1
        RECORD.reset()
        RECORD.device_probe = _cuda_event if dist.get_backend() == "nccl" else None  # Note [progress record]
        self.watchdog = HeartbeatWatchdog(
            _side_channel(self.timeout_s), rank, world_size, self.timeout_s, self.on_hang,
            prefix=f"lightning_zero/heartbeat/{_generation[0]}", record=RECORD,
        ).start()

    def stop(self) -> None:
        """Stop beating and tell the other ranks this one is done (idempotent)."""
        RECORD.device_probe = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def mark(self, phase: str, trainer: pl.Trainer, long_phase: bool = False) -> None:
        """Record ``phase`` at the Trainer's step. Every phase is long until a step time was measured (the
        first steps of each fit, resumed or not: compilation, warm-up), then the stall threshold covers steps."""
        if self.watchdog is not None:
            measured = self.watchdog.record.step_s > 0
            self.watchdog.mark(phase, trainer.global_step, long_phase or not measured)

    # Lightning hook -> the phase a rank is reported in; long ones never count as stuck
    on_before_backward = _marks("backward (gradient reduction)")
    on_before_optimizer_step = _marks("optimizer step (parameter all-gather)")
    on_save_checkpoint = _marks("checkpoint save", long_phase=True)
    on_validation_batch_start = _marks("validation step")
    on_validation_batch_end = _marks("between validation steps (data loading)", long_phase=True)
    on_validation_end = _marks("between steps (callbacks, logging, data loading)", long_phase=True)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.watchdog is not None:
            self._step_started = self.watchdog.clock()
        self.mark("training_step", trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._batches += 1  # of this fit (start() resets it): a resumed fit's first step compiles too
        if self.watchdog is not None and self._step_started is not None and self._batches > 1:
            record = self.watchdog.record
            record.step_s = max(record.step_s, self.watchdog.clock() - self._step_started)
        self.mark("between steps (callbacks, logging, data loading)", trainer, long_phase=True)

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any) -> None:
        self.stop()


@contextmanager
def long_phase(name: str, record: ProgressRecord = RECORD) -> Iterator[None]:
    """``with lightning_zero.long_phase("sampling"):`` around legitimate work one rank does alone (sample
    generation on rank 0, an evaluation): while inside, no rank is reported stuck (this rank is still watched
    for silence; ``zero.timeout_s`` bounds it). The phase before it is restored on exit."""
    phase, step, was_long = record.phase, record.step, record.long_phase
    record.mark(name, step, long_phase=True)
    try:
        yield
    finally:
        record.mark(phase, step, was_long)


def _cuda_event() -> torch.cuda.Event:
    """An event recorded on the current stream now: it completes once the collective just queued did."""
    event = torch.cuda.Event()
    event.record()
    return event


class RecordedCollectives:
    """Strategy part: the progress record's entry around each of Lightning's own collectives (barrier,
    broadcast, reduce), so the hang watchdog can name them (Note [progress record] in
    core/reliability/progress_record.py). The strategy wraps its ``super()`` call in the one it runs::

        with self._collectives.barrier(name):
            super().barrier(name)

    Args:
        record: the progress record the entries go into.
        settle: called before each collective is entered (the strategy's: raise another rank's step error first).
    """

    def __init__(self, record: ProgressRecord = RECORD, settle: Callable[[], None] | None = None) -> None:
        self._record = record
        self._settle = settle

    def barrier(self, name: str | None = None) -> AbstractContextManager[Any]:
        return self._entered(f"barrier({name})" if name else "barrier")

    def broadcast(self) -> AbstractContextManager[Any]:
        return self._entered("broadcast (Lightning)")

    def reduce(self) -> AbstractContextManager[Any]:
        return self._entered("reduce (Lightning, e.g. self.log sync_dist)")

    @contextmanager
    def _entered(self, what: str) -> Iterator[None]:
        if self._settle is not None:
            self._settle()
        with self._record.collective(what):
            yield


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
