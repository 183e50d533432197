"""Agreements settled later, and the entry every collective of the strategy goes through.

Note [deferred agreement]
    An agreement that must hold before a rank waits on the others (did any rank's step raise?)
    needs no synchronisation of its own: the flags are all-reduced asynchronously
    (:meth:`~lightning_zero.core.comm.data_parallel.DataParallelComm.ranks_with_later`) and read when
    this rank next enters any collective of the strategy (:func:`strategy_collective` settles them
    first: ZeRO's, tensor and sequence parallel's, the pipeline's), or one of Lightning's (the strategy's
    ``barrier`` / ``broadcast`` / ``reduce``), or at the end of training. A rank that is going to raise
    waits for the answer itself; the others learn it before they wait on a collective the raising rank
    never joins, whatever group it is over, so every rank raises and none hangs. The pending agreements
    are this process's (one model trains at a time, as for the progress record): an agreement over every
    rank is settled before a collective of a tensor-parallel group as before one of the data group. The
    all-reduce is numbered like the strategy's other collectives, so the hang watchdog names a rank
    waiting in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_zero.core.reliability.progress_record import RECORD


class Handle(Protocol):
    def wait(self) -> object: ...


class _Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


DONE: Handle = _Done()


class DeferredFlags:
    """An issued all-reduce of one flag per rank (Note [deferred agreement]); ``group``: the process group it
    runs over (forgotten with it)."""

    def __init__(self, flags: torch.Tensor, handle: Handle, group: Any = None) -> None:
        self.flags, self.handle, self.group = flags, handle, group
        # the error raise_if_any raises when some ranks' flags are set, made from those ranks
        self.error_for: Callable[[list[int]], BaseException] | None = None
        # when the all-reduce itself fails (a rank's process ended): the error to raise instead, or None
        self.when_lost: Callable[[], BaseException | None] | None = None

    def ranks(self) -> list[int]:
        """The ranks whose flag is set (waits for the all-reduce; the same on every rank)."""
        handle, self.handle = self.handle, DONE
        handle.wait()
        return [r for r in range(self.flags.numel()) if self.flags[r].item()]

    def ranks_within(self, seconds: float) -> list[int] | None:
        """:meth:`ranks`, or ``None`` when the all-reduce has not completed after ``seconds`` (some rank waits in
        another collective; the all-reduce stays issued)."""
        done = getattr(self.handle, "is_completed", None)
        deadline = time.monotonic() + seconds
        while done is not None and not done():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return self.ranks()

    def raise_if_any(self) -> None:
        try:
            failed = self.ranks()
        except Exception as lost:  # a rank left before it answered: say which failed first, where known
            named = self.when_lost() if self.when_lost is not None else None
            if named is None:
                raise
            raise named from lost
        if failed and self.error_for is not None:
            raise self.error_for(failed)


_PENDING: list[DeferredFlags] = []  # this process's agreements not yet settled, oldest first


def defer(pending: DeferredFlags) -> None:
    """Settle ``pending`` (raise its error) before this process next enters a collective of the strategy."""
    _PENDING.append(pending)


def settle_pending() -> None:
    """Wait for the deferred agreements and raise the first one's error (Note [deferred agreement])."""
    while _PENDING:
        _PENDING.pop(0).raise_if_any()


def forget_pending(group: Any) -> None:
    """Drop the agreements over ``group``, which is being destroyed: their peers are gone with it."""
    _PENDING[:] = [p for p in _PENDING if p.group is not group]


def strategy_collective(kind: str) -> Any:
    """``with strategy_collective("tensor-parallel all_reduce"):`` around a blocking collective the strategy
    issues outside :class:`~lightning_zero.core.comm.data_parallel.DataParallelComm`: the deferred agreements
    are settled first, then the collective is numbered for the hang watchdog (Note [progress record])."""
    settle_pending()
    return RECORD.collective(kind)
