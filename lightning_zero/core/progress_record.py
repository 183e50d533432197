"""This rank's progress, as the hang watchdog publishes it: the strategy's collective it is in (or user
code at step S), the training phase, and how long ago any of that last changed.

Note [progress record]
    Every collective the strategy issues (``DataParallelComm``, Lightning's barrier / broadcast /
    reduce through ``ZeroStrategy``, the pipeline's schedule and loss broadcast) goes through
    :meth:`ProgressRecord.collective`: entry numbers it (``seq``, the same on every rank as long
    as the ranks issue the same collectives in the same order) and marks the rank as waiting in it;
    exit marks it back in user code. An asynchronous collective is numbered when issued and its
    ``wait()`` is recorded as waiting in that number (:meth:`ProgressRecord.waiting`).

    The cost is a few attribute writes and one monotonic clock read per collective: no lock, no
    store call, no extra collective. The heartbeat thread reads the fields without a lock; a torn
    read (a field from before, one from after a change) is harmless: the next beat corrects it,
    and the watchdog needs ``hang_timeout_s`` of unchanged progress before it says anything.

    One record per process (:data:`RECORD`): a process trains one model at a time, and every rank
    resets it when its watchdog starts, so the numbers agree across ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

_SEP = "\t"


@dataclass(frozen=True)
class RankProgress:
    """One rank's published progress (see :meth:`ProgressRecord.to_text`).

    ``waiting_seq``: the number of the strategy collective the rank waits in (0: it is in user code,
    after collective ``seq``); ``age_s``: seconds since any field last changed, on the rank's clock.
    """

    beats: int
    seq: int
    waiting_seq: int
    kind: str
    step: int
    phase: str
    long_phase: bool
    step_s: float
    age_s: float

    @property
    def inside(self) -> bool:
        """Whether the rank waits in a collective of the strategy."""
        return self.waiting_seq > 0

    @property
    def position(self) -> tuple[int, int, str, int, str]:
        """What must stay the same for the rank to be making no progress."""
        return (self.seq, self.waiting_seq, self.kind, self.step, self.phase)

    def where(self) -> str:
        """``waiting in the strategy's collective #12 all_reduce (step 3, 'backward')`` or ``outside the
        strategy, in user code at step 3 ('training_step'), after collective #11 all_gather``."""
        at = f"step {self.step}, {self.phase!r}"
        if self.inside:
            return f"waiting in the strategy's collective #{self.waiting_seq} {self.kind} ({at})"
        after = f"after collective #{self.seq} {self.kind}" if self.seq else "before any collective of the strategy"
        return f"outside the strategy, in user code at step {self.step} ({self.phase!r}), {after}"


def parse_progress(text: str) -> RankProgress | None:
    """The :class:`RankProgress` of a published beat (``None``: not a beat, e.g. ``done``)."""
    parts = text.split(_SEP)
    if len(parts) != 9:
        return None
    try:
        return RankProgress(int(parts[0]), int(parts[1]), int(parts[2]), parts[3], int(parts[4]), parts[5],
                            parts[6] == "1", float(parts[7]), float(parts[8]))
    except ValueError:
        return None


class _Inside:
    """The context of one collective (a class, not a generator: it runs on every collective)."""

    __slots__ = ("kind", "record", "seq")

    def __init__(self, record: ProgressRecord, kind: str, seq: int | None) -> None:
        self.record, self.kind, self.seq = record, kind, seq

    def __enter__(self) -> None:
        r = self.record
        if self.seq is None:
            r.seq += 1
            r.kind = self.kind
        r.waiting_seq, r.waiting_kind = (r.seq if self.seq is None else self.seq), self.kind
        r.changed_at = r.clock()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        r = self.record
        r.waiting_seq = 0
        r.changed_at = r.clock()


class ProgressRecord:
    """What this rank is doing, for the heartbeat (Note [progress record]).

    Args:
        clock: the monotonic clock (a test may pass its own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        """Back to ``setup`` before any collective (every rank does it when its watchdog starts)."""
        self.seq, self.kind = 0, ""  # the last collective entered
        self.waiting_seq, self.waiting_kind = 0, ""  # the one the rank waits in now (0: none)
        self.step, self.phase, self.long_phase = 0, "setup", True
        self.step_s = 0.0  # the longest training step seen (after the first)
        self.changed_at = self.clock()

    def collective(self, kind: str) -> _Inside:
        """``with record.collective("all_reduce"):`` around a blocking strategy collective (numbers it)."""
        return _Inside(self, kind, None)

    def issued(self, kind: str) -> int:
        """Number an asynchronous collective just issued; returns its number for :meth:`waiting`."""
        self.seq += 1
        self.kind = kind
        self.changed_at = self.clock()
        return self.seq

    def waiting(self, seq: int, kind: str) -> _Inside:
        """``with record.waiting(n, kind):`` around the ``wait()`` of asynchronous collective ``n``."""
        return _Inside(self, kind, seq)

    def mark(self, phase: str, step: int, long_phase: bool = False) -> None:
        """The training phase this rank entered; ``long_phase``: legitimately long (a save, the first
        step), never reported as stuck (Note [hang watchdog] in core/heartbeat.py)."""
        self.phase, self.step, self.long_phase = phase, step, long_phase
        self.changed_at = self.clock()

    def to_text(self, beats: int) -> str:
        """The beat's text: counter, progress fields and their age (parsed by :func:`parse_progress`)."""
        kind = self.waiting_kind if self.waiting_seq else self.kind
        fields = (beats, self.seq, self.waiting_seq, kind, self.step, self.phase.replace(_SEP, " "),
                  int(self.long_phase), f"{self.step_s:.3f}", f"{max(0.0, self.clock() - self.changed_at):.3f}")
        return _SEP.join(str(f) for f in fields)


RECORD = ProgressRecord()  # this process's record: written by the strategy's collectives, read by the heartbeat
