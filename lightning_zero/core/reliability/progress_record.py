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

    NCCL (and any backend whose collectives run asynchronously to the host) returns from a
    collective as soon as it is queued: the host blocks later, at a ``.item()`` or a copy to the
    CPU, outside any recorded block. The record therefore also holds the last collective issued
    (:attr:`ProgressRecord.pending`: its number, kind and something to poll, a work handle's
    ``is_completed()`` or a CUDA event recorded after it, see :attr:`ProgressRecord.device_probe`);
    the heartbeat thread polls it, and a rank whose last issued collective has not completed is
    published as waiting in it, on NCCL as on gloo. Collectives of one process group complete in
    the order issued, so the last one incomplete means the rank waits in it or in an earlier one of
    that group; one attribute write (and, on NCCL, one CUDA event) per collective.

    One record per process (:data:`RECORD`): a process trains one model at a time, and every rank
    resets it when its watchdog starts, so the numbers agree across ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

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

    __slots__ = ("kind", "outer", "record", "seq")

    def __init__(self, record: ProgressRecord, kind: str, seq: int | None) -> None:
        self.record, self.kind, self.seq = record, kind, seq
        self.outer: tuple[int, str] = (0, "")

    def __enter__(self) -> None:
        r = self.record
        self.outer = (r.waiting_seq, r.waiting_kind)  # blocks nest (a collective inside the pipeline schedule)
        if self.seq is None:
            r.seq += 1
            r.kind = self.kind
        r.waiting_seq, r.waiting_kind = (r.seq if self.seq is None else self.seq), self.kind
        r.changed_at = r.clock()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        r = self.record
        if err is not None:
            r.broken += 1
        if r.device_probe is not None:  # the device may still run it: poll until done (Note [progress record])
            r.pending = (r.waiting_seq, r.waiting_kind, r.device_probe())
        r.waiting_seq, r.waiting_kind = self.outer  # back in the enclosing block, or user code (0)
        r.changed_at = r.clock()


def _completed(probe: Any) -> bool:
    """Whether a work handle (``is_completed``) or a CUDA event (``query``) finished; a probe that
    cannot say (its process group is gone) counts as finished."""
    try:
        return bool(probe.is_completed() if hasattr(probe, "is_completed") else probe.query())
    except Exception:
        return True


class ProgressRecord:
    """What this rank is doing, for the heartbeat (Note [progress record]).

    Args:
        clock: the monotonic clock (a test may pass its own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.broken = 0  # collectives of the strategy that raised (a peer gone, a timeout): Note [first step error]
        # NCCL: a probe of the device's progress made after each blocking collective (a recorded CUDA
        # event); None where collectives block the host (gloo)
        self.device_probe: Callable[[], Any] | None = None
        self.reset()

    def reset(self) -> None:
        """Back to ``setup`` before any collective (every rank does it when its watchdog starts)."""
        self.seq, self.kind = 0, ""  # the last collective entered
        self.waiting_seq, self.waiting_kind = 0, ""  # the one the rank waits in now (0: none)
        self.step, self.phase, self.long_phase = 0, "setup", True
        self.step_s = 0.0  # the longest training step seen (after the first)
        self.pending: tuple[int, str, Any] | None = None  # the last collective issued: seq, kind, probe
        self._published_wait: tuple[int, str] = (0, "")  # heartbeat thread only: the wait it last published
        self._published_changed_at: float | None = None  # heartbeat thread only: changed_at at the last beat
        self._wait_changed = self.clock()
        self.changed_at = self.clock()

    def track(self, seq: int, kind: str, work: Any) -> None:
        """Collective ``seq`` was issued asynchronously with handle ``work`` (``is_completed()``): until it
        completes this rank counts as waiting in it when outside a recorded block."""
        self.pending = (seq, kind, work)

    def current_wait(self) -> tuple[int, str]:
        """``(seq, kind)`` of the collective this rank waits in: the recorded block it is in, else the last
        issued collective not yet completed (polled); ``(0, kind of the last)`` in user code."""
        if self.waiting_seq:
            return self.waiting_seq, self.waiting_kind
        pending = self.pending
        if pending is not None and pending[0] and not _completed(pending[2]):
            return pending[0], f"{pending[1]} (issued, not completed)"
        return 0, self.kind

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
        step), never reported as stuck (Note [hang watchdog] in core/reliability/heartbeat.py)."""
        self.phase, self.step, self.long_phase = phase, step, long_phase
        self.changed_at = self.clock()

    def to_text(self, beats: int) -> str:
        """The beat's text: counter, progress fields and their age (parsed by :func:`parse_progress`)."""
        waiting_seq, kind = self.current_wait()
        now = self.clock()
        if (waiting_seq, kind) != self._published_wait:
            # a change the main thread made is dated by changed_at; one only the device made (a pending
            # collective completed) happened since the last beat: date it now
            device_only = self.changed_at == self._published_changed_at
            self._published_wait, self._wait_changed = (waiting_seq, kind), now if device_only else self.changed_at
        self._published_changed_at = self.changed_at
        age = now - max(self.changed_at, self._wait_changed)
        fields = (beats, self.seq, waiting_seq, kind.replace(_SEP, " "), self.step, self.phase.replace(_SEP, " "),
                  int(self.long_phase), f"{self.step_s:.3f}", f"{max(0.0, age):.3f}")
        return _SEP.join(str(f) for f in fields)


RECORD = ProgressRecord()  # this process's record: written by the strategy's collectives, read by the heartbeat
