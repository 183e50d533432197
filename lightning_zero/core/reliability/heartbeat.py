"""Hang detection over the rendezvous store: a heartbeat thread per rank publishing its progress, rank 0
aggregating everyone's into one verdict that every rank reads, naming silent or stuck ranks.

Note [hang watchdog]
    A rank that stops (SIGSTOP, a frozen host) or that is alive but took another code path (an
    extra collective, data-dependent control flow) leaves the others blocked inside a collective
    until its timeout (``timeout_s``, 300 s by default), and gloo's message then names no rank.
    Each rank therefore runs a daemon thread that, every ``interval_s``:

    1. publishes its beat under its own key in the store the process group was rendezvoused on
       (torchrun's store, Lightning's TCPStore, a FileStore), a side channel that works while the
       main thread is blocked in a collective: a beat counter and its progress (Note [progress
       record] in core/reliability/progress_record.py: the strategy collective it waits in, or user code at
       step S, the phase, and how long ago that last changed);
    2. on rank 0 (the aggregator): reads every rank's key in one ``multi_get`` (N - 1 key reads),
       decides, and publishes one verdict key with a round counter; on every other rank: reads
       the verdict only (one key read). Reads per interval: 2(N - 1), not N(N - 1) as when every
       rank read every other's key.

    The verdict, on rank 0's monotonic clock (no clock synchronisation between hosts):

    - **silent**: a rank whose beat counter has not changed for ``timeout_s`` (exit code 75);
    - **stuck**: every rank beat within the last 3 intervals, at least one waits in a strategy
      collective, none is in a long phase, and no rank's progress changed for ``max(timeout_s,
      3 x the longest training step seen)``: the ranks are grouped by where they are, the odd ones
      named behind / ahead / in another collective / in user code (exit code 76). A rank's
      progress age is the one it published plus the time since rank 0 first saw that beat: up to
      one interval short. Rank 0 therefore decides at the threshold less one interval, and every
      thread wakes when its next threshold falls (:meth:`HeartbeatWatchdog.next_wait_s`), so the
      other ranks read the verdict within one interval: every rank has the finding by
      ``timeout_s`` + one interval after the last change.

    Long legitimate phases (setup and checkpoint loading, the first training step with its
    compilation, a checkpoint save, between steps: callbacks and the data loader) are marked
    ``long_phase`` by the Lightning glue: while any rank is in one, nobody is reported stuck (a
    rank in them is still watched for silence; ``zero.timeout_s`` bounds them). A rank that
    stopped its watchdog normally publishes ``done`` (a finished rank), rank 0 a ``done`` verdict.

    Rank 0 itself is watched by the others through the verdict's round counter: unchanged for
    ``timeout_s`` means rank 0 is silent; the first rank to see it swaps the verdict for its
    finding (``compare_set``) so every rank names the same; rank 0 also publishes with
    ``compare_set``, so a rank 0 that wakes up adopts that finding instead of overwriting it.
    If the store stops answering for
    ``timeout_s`` (its host is the hung process) that is reported, naming the store. Every rank
    prints the finding, adds one to an acknowledgement counter and waits (at most two intervals)
    for the others' before exiting, so a launcher that stops the job at the first exit does not
    cut a rank's report short. Each rank publishes its process once, at start; a silent finding
    carries the silent ranks' (Note [ending a silent rank] in ``rank_process.py``: the reporting
    ranks end a stopped rank they can reach, so that its launcher ends the job at once).

    ``dist.monitored_barrier`` was not used: it is a collective all survivors must enter together,
    and only rank 0 learns who is missing.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lightning_zero.core.reliability.hang_finding import (
    SILENT_EXIT_CODE,
    STUCK_EXIT_CODE,
    SilentRank,
    silent_text,
    stuck_text,
)
from lightning_zero.core.reliability.progress_record import RECORD, ProgressRecord, parse_progress
from lightning_zero.core.reliability.rank_process import is_stopped, process_text

__all__ = ["DONE", "HangReport", "HeartbeatWatchdog", "SilentRank", "interval_for"]

DONE = "done"
STEP_MARGIN = 3.0  # a stall must also last this many of the longest training step seen


@dataclass(frozen=True)
class HangReport:
    """A finding, the same on every rank (composed by rank 0, or by the rank that found rank 0 silent).

    ``kind``: ``"silent"``, ``"stuck"`` or ``"store"``; ``rank``: the rank printing it.
    """

    rank: int
    kind: str
    text: str
    timeout_s: float
    silent: tuple[SilentRank, ...] = ()
    store_failure: str | None = None
    live_ranks: int = 1  # ranks expected to acknowledge the finding

    @property
    def exit_code(self) -> int:
        """75 for a silent rank (or store), 76 for live ranks that stopped making progress."""
        return STUCK_EXIT_CODE if self.kind == "stuck" else SILENT_EXIT_CODE

    def message(self) -> str:
        """The finding as this rank prints it."""
        return (f"[lightning-zero] hang detected (rank {self.rank} reporting, exit code {self.exit_code}): "
                f"{self.text}")


def interval_for(timeout_s: float) -> float:
    """Heartbeat period: an eighth of the timeout, between 50 ms and 2 s."""
    return min(2.0, max(0.05, timeout_s / 8))


class HeartbeatWatchdog:
    """A rank's heartbeat publisher; on rank 0 the aggregator of everyone's, elsewhere the reader of its verdict.

    Args:
        store: a c10d store (or anything with ``set``/``get``/``multi_get``/``check``/``compare_set``/
            ``add``) every rank can reach.
        rank, world_size: this rank and the number of ranks that beat.
        timeout_s: seconds without a beat, or without progress, after which ranks are reported.
        on_hang: called once, from the watchdog thread, with the :class:`HangReport`.
        interval_s: heartbeat period (default :func:`interval_for`).
        clock: the monotonic clock (a test may pass its own).
        prefix: the keys' prefix (one per watchdog generation).
        record: this rank's progress (default: the process's
            :data:`~lightning_zero.core.reliability.progress_record.RECORD`).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_hang: Callable[[HangReport], None],
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefix: str = "lightning_zero/heartbeat",
        record: ProgressRecord | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"hang timeout must be positive seconds, got {timeout_s!r} (0 or None disables it).")
        self.store, self.prefix = store, prefix
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.on_hang = on_hang
        self.interval_s = interval_for(timeout_s) if interval_s is None else interval_s
        self.clock = clock
        self.record = record if record is not None else ProgressRecord(clock) if clock is not time.monotonic else RECORD
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = clock()
        self._last_answer = now
        self._error: str | None = None  # the last store error, if any
        self._lock = threading.Lock()
        self.report: HangReport | None = None  # set once a hang was found
        # rank 0: every rank's last beat text, when it changed, and the ranks whose key exists
        self._seen: dict[int, str] = {}
        self._changed: dict[int, float] = {r: now for r in range(world_size)} if rank == 0 else {}
        self._present: list[int] = []
        self._round = 0
        self._written: str | None = None  # the verdict rank 0 last published
        # other ranks: the last verdict and when it changed
        self._verdict: str | None = None
        self._verdict_changed = now
        self._aggregator_done = False
        self._rank0_process: str | None = None  # rank 0's published process (Note [ending a silent rank])
        self._due = now + self.interval_s  # when the next threshold is crossed, as far as the last round knew

    def key(self, name: str) -> str:
        """The store key of ``name`` under this watchdog's prefix."""
        return f"{self.prefix}/{name}"

    @property
    def step(self) -> int:
        return self.record.step

    @property
    def operation(self) -> str:
        return self.record.phase

    def mark(self, operation: str, step: int | None = None, long_phase: bool = False) -> None:
        """Record the phase this rank entered (published with the next beat)."""
        self.record.mark(operation, self.record.step if step is None else step, long_phase)

    def start(self) -> HeartbeatWatchdog:
        """Publish the first beat and start the daemon threads."""
        now = self.clock()
        self._last_answer = self._verdict_changed = now
        self._changed = {r: now for r in range(self.world_size)} if self.rank == 0 else {}
        self.store.set(self.key(f"process/{self.rank}"), process_text())  # Note [ending a silent rank]
        if self.rank != 0 and self.store.check([self.key("process/0")]):  # rank 0 started first (else: below)
            self._read_rank0_process()
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"lightning-zero-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        # the store calls above may block (its host hung): a second thread watches their answers
        threading.Thread(target=self._watch_store, name=f"lightning-zero-store-watch-{self.rank}", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop the threads and publish ``done`` (this rank is no longer watched; rank 0: nor watching)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5.0)
        self._thread = None
        with contextlib.suppress(Exception):  # the store may be gone at teardown: nobody to tell then
            self.store.set(self.key(f"hb/{self.rank}"), DONE)
            if self.rank == 0 and self.report is None:
                self.store.set(self.key("verdict"), f"{self._round + 1}\t{DONE}")

    def beat(self) -> None:
        """Publish this rank's beat counter and progress."""
        self._beats += 1
        self.store.set(self.key(f"hb/{self.rank}"), self.record.to_text(self._beats))

    def check(self) -> HangReport | None:
        """One round: rank 0 aggregates and publishes the verdict, the others read it. The report of a
        finding (the same on every rank), or ``None``."""
        report = self._aggregate() if self.rank == 0 else self._read_verdict()
        self._last_answer = self.clock()
        return report

    # ------------------------------------------------------------------ rank 0
    def _aggregate(self) -> HangReport | None:
        missing = [r for r in range(1, self.world_size) if r not in self._seen and r not in self._present]
        if missing:  # get() of a key nobody set would wait for it: check the absent ones (until all are there)
            found = self.store.check([self.key(f"hb/{r}") for r in missing])
            self._present += missing if found else [r for r in missing if self.store.check([self.key(f"hb/{r}")])]
        values = self.store.multi_get([self.key(f"hb/{r}") for r in self._present]) if self._present else []
        now = self.clock()
        for r, raw in zip(self._present, values):
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            if text != self._seen.get(r):
                self._seen[r], self._changed[r] = text, now
        self._seen[0], self._changed[0] = self.record.to_text(self._beats), now
        report = self._decide(now)
        self._round += 1
        value = f"{self._round}\t{'ok' if report is None else _encode(report)}"
        if self._written is None:  # the first verdict: nobody can have a finding yet
            self.store.set(self.key("verdict"), value)
        else:  # never over another rank's finding (it found rank 0 silent): that one is the job's
            current = self.store.compare_set(self.key("verdict"), self._written, value)
            current = current.decode() if isinstance(current, bytes) else str(current)
            status = current.split("\t", 1)[1] if "\t" in current else ""
            if current != value and status not in ("ok", DONE, ""):
                return self._decode(status)
        self._written = value
        return report

    def _decide(self, now: float) -> HangReport | None:
        done = {r for r, text in self._seen.items() if text == DONE}
        silent = [_silent(r, now - self._changed[r], self._seen.get(r)) for r in range(self.world_size)
                  if r not in done and now - self._changed[r] >= self.timeout_s]
        watched = [r for r in range(self.world_size) if r not in done]
        self._due = min((self._changed[r] + self.timeout_s for r in watched), default=now + self.interval_s)
        if silent:
            silent = self._with_processes(silent)
            return self._report("silent", silent_text(silent, self.timeout_s), silent)
        states = {r: parse_progress(self._seen.get(r, "")) for r in range(self.world_size)}
        live = {r: s for r, s in states.items() if r not in done}
        fresh = all(s is not None and now - self._changed[r] <= 3 * self.interval_s for r, s in live.items())
        if not live or not fresh or any(s.long_phase for s in live.values() if s is not None):
            return None
        if not any(s is not None and s.inside for s in live.values()):
            return None  # everyone in user code: a long step looks the same (zero.timeout_s bounds it)
        ages = [s.age_s + (0.0 if r == 0 else now - self._changed[r]) for r, s in live.items() if s is not None]
        stall = min(ages)
        longest_step = max(s.step_s for s in live.values() if s is not None)
        # Note [hang watchdog]: the ages seen here are up to one interval old and the others read the
        # verdict up to one interval later: deciding one interval early ends the job by timeout + interval
        limit = max(self.timeout_s, STEP_MARGIN * longest_step)
        threshold = limit - self.interval_s
        if stall < threshold:
            self._due = min(self._due, now + threshold - stall)
            return None
        shown = {r: (None if r in done else states[r]) for r in range(self.world_size)}
        return self._report("stuck", stuck_text(shown, stall, self.timeout_s, limit, self.interval_s))

    # ------------------------------------------------------------------ ranks 1..N-1
    def _read_verdict(self) -> HangReport | None:
        key = self.key("verdict")
        raw = None
        if self._verdict is not None or self.store.check([key]):
            raw = self.store.get(key)
            raw = raw.decode() if isinstance(raw, bytes) else str(raw)
            if self._rank0_process is None:  # published before rank 0's first verdict: read once
                self._read_rank0_process()
        now = self.clock()
        if raw is not None:
            status = raw.split("\t", 1)[1] if "\t" in raw else ""
            if status == DONE:
                self._aggregator_done = True
                return None
            if status not in ("ok", ""):
                return self._decode(status)
            if raw != self._verdict:
                self._verdict, self._verdict_changed = raw, now
                return None
        self._due = self._verdict_changed + self.timeout_s
        if self._aggregator_done or now - self._verdict_changed < self.timeout_s:
            return None
        # rank 0 (the aggregator) stopped publishing: name it, and make that the verdict every rank reads
        last = self.store.get(self.key("hb/0")) if self.store.check([self.key("hb/0")]) else b""
        text = last.decode() if isinstance(last, bytes) else str(last)
        silent = self._with_processes([_silent(0, now - self._verdict_changed, text)])
        mine = self._report("silent", silent_text(silent, self.timeout_s), silent)
        current = self.store.compare_set(key, raw or "", f"{(raw or '0').split(chr(9))[0]}\t{_encode(mine)}")
        current = current.decode() if isinstance(current, bytes) else str(current)
        status = current.split("\t", 1)[1] if "\t" in current else ""
        if status in ("ok", DONE):  # rank 0 published again meanwhile: it is not silent
            self._verdict, self._verdict_changed = current, now
            return None
        return self._decode(status) if status else mine

    def _read_rank0_process(self) -> None:
        """Keep rank 0's published process, if it is there yet: should the store (rank 0's under Lightning's
        launcher) stop answering, rank 0 is ended where it is seen stopped (Note [ending a silent rank])."""
        found = self.store.check([self.key("process/0")])
        self._rank0_process = _text(self.store.get(self.key("process/0"))) if found else ""

    # ------------------------------------------------------------------ both
    def _with_processes(self, silent: list[SilentRank]) -> list[SilentRank]:
        """The silent ranks with the processes they published at start (Note [ending a silent rank])."""
        keys = [self.key(f"process/{s.rank}") for s in silent]
        known = [k for k in keys if self.store.check([k])]
        found = dict(zip(known, self.store.multi_get(known))) if known else {}
        return [replace(s, process=_text(found[k])) if k in found else s for s, k in zip(silent, keys)]

    def _report(self, kind: str, text: str, silent: list[SilentRank] | None = None,
                store_failure: str | None = None) -> HangReport:
        return HangReport(self.rank, kind, text, self.timeout_s, tuple(silent or ()), store_failure,
                          max(1, self.world_size - len(silent or ())))

    def _decode(self, payload: str) -> HangReport:
        data = json.loads(payload)
        silent = [SilentRank(*s) for s in data["silent"]]
        return self._report(data["kind"], data["text"], silent)

    def settle(self, linger_s: float) -> None:
        """Acknowledge the finding and wait (at most ``linger_s``) until every live rank has: the store's
        host and the launcher then stop no rank before it printed its report."""
        deadline = self.clock() + linger_s
        with contextlib.suppress(Exception):
            acked = self.store.add(self.key("acks"), 1)
            expected = self.report.live_ranks if self.report is not None else 1
            while acked < expected and self.clock() < deadline:
                time.sleep(0.05)
                acked = self.store.add(self.key("acks"), 0)

    def next_wait_s(self) -> float:
        """Seconds until the next round: one interval, or less when a threshold (a silence, a stall) is
        crossed sooner, so the finder decides on time and every other rank reads it within one interval
        (Note [hang watchdog]: the job ends within ``timeout_s`` + one interval)."""
        return min(self.interval_s, max(0.01, self._due - self.clock()))

    def _run(self) -> None:
        while not self._stop.wait(self.next_wait_s()):
            try:
                self.beat()
                report = self.check()
            except Exception as err:  # a silent store is itself a finding
                self._error = f"{type(err).__name__}: {err}"
                continue
            if report is not None:
                self._found(report)
                return

    def _watch_store(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.clock() - self._last_answer >= self.timeout_s:
                failure = self._error or "no answer"
                text = (f"the rendezvous store did not answer heartbeats for {self.timeout_s:.0f} s ({failure}); "
                        "the process hosting it (rank 0's under Lightning's launcher, torchrun's agent otherwise) "
                        "is hung or gone.")
                silent = []  # rank 0 stopped on this host: the store's host under Lightning's launcher, ended too
                if self._rank0_process and is_stopped(self._rank0_process):
                    silent = [SilentRank(0, round(self.clock() - self._last_answer, 1), None, None,
                                         self._rank0_process)]
                    text += f" Rank 0 (pid {silent[0].pid}) is stopped."
                self._found(self._report("store", text, silent, store_failure=failure))
                return

    def _found(self, report: HangReport) -> None:
        with self._lock:
            if self.report is not None or self._stop.is_set():
                return
            self.report = report
        self.on_hang(report)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _encode(report: HangReport) -> str:
    silent = [[s.rank, s.silent_s, s.step, s.operation, s.process] for s in report.silent]
    return json.dumps({"kind": report.kind, "text": report.text, "silent": silent})


def _silent(rank: int, silent_s: float, text: str | None) -> SilentRank:
    """A silent rank with the step and phase of its last beat (``None`` fields: never seen)."""
    state = parse_progress(text or "")
    if state is None:
        return SilentRank(rank, round(silent_s, 1), None, None)
    return SilentRank(rank, round(silent_s, 1), state.step, state.phase)

