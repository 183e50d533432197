"""Hung-rank detection: a heartbeat thread per rank over the rendezvous store, naming silent ranks.

Note [hang watchdog]
    A rank that stops (SIGSTOP, a frozen host, a lost network) leaves the others blocked inside a
    collective until its timeout (``timeout_s``, 300 s by default), and gloo's message then names
    no rank. Each rank therefore runs a daemon thread that, every ``interval_s``:

    1. publishes ``<beat counter> <step> <operation>`` under its own key in the store the process
       group was rendezvoused on (torchrun's store, Lightning's TCPStore, a FileStore): a side
       channel that works while the main thread is blocked in a collective;
    2. reads every rank's key in one ``multi_get`` and notes, on its own monotonic clock, when each
       counter last changed (no clock synchronisation between hosts is needed);
    3. when some rank's counter has not changed for ``timeout_s``, reports those ranks once:
       their rank, the operation and step they were last seen in, and this rank's own operation
       and step (``on_hang``; the Lightning glue prints it and ends the process, see
       ``lightning_zero/hang_watchdog.py``).

    Liveness, not progress, is watched: a rank busy for a long time (a large checkpoint save, a
    slow first step) keeps beating from its thread, so long legitimate work never trips it. A rank
    that is alive but stuck (a deadlock in user code) keeps beating too: the collective timeout
    still ends that case. A rank that stopped its watchdog normally publishes ``done`` and is no
    longer watched. If the store itself stops answering for ``timeout_s`` (its host is the hung
    process) that is reported the same way, naming the store.

    ``dist.monitored_barrier`` was not used: it is a collective every surviving rank must enter
    together, and only rank 0 learns which ranks are absent (a stopped rank 0 is named by nobody).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

DONE = "done"
_KEY = "hb/{}"
_FOUND = "found"  # the first report of silent ranks, for every survivor


@dataclass(frozen=True)
class SilentRank:
    """A rank whose heartbeat stopped: its last published step and operation (``None``: never seen)."""

    rank: int
    silent_s: float
    step: int | None
    operation: str | None


@dataclass(frozen=True)
class HangReport:
    """What a surviving rank knows when it finds silent ranks."""

    rank: int
    step: int
    operation: str
    silent: tuple[SilentRank, ...]
    timeout_s: float
    store_failure: str | None = None  # the side channel itself stopped answering

    def message(self) -> str:
        """The error text: the silent ranks, where they were, and where this rank waits."""
        if self.store_failure is not None:
            head = (f"the rendezvous store did not answer heartbeats for {self.timeout_s:.0f} s "
                    f"({self.store_failure}); the process hosting it (rank 0's under Lightning's launcher, "
                    "torchrun's agent otherwise) is hung or gone.")
        else:
            who = ", ".join(
                f"rank {s.rank} (silent {s.silent_s:.0f} s, last seen "
                + ("never" if s.step is None else f"at step {s.step} in {s.operation!r}") + ")"
                for s in self.silent
            )
            head = (f"no heartbeat from {who} for more than zero.hang_timeout_s={self.timeout_s:g} s: the "
                    "process is stopped, frozen or its host is unreachable.")
        return (f"[lightning-zero] hang detected on rank {self.rank} at step {self.step} in {self.operation!r}: "
                f"{head} Stopping this rank instead of waiting for the collective timeout (zero.timeout_s). "
                "Check the named rank's host (dmesg, OOM killer, a debugger or SIGSTOP); raise "
                "zero.hang_timeout_s if the host is only very slow.")


def interval_for(timeout_s: float) -> float:
    """Heartbeat period: a sixth of the timeout, between 50 ms and 5 s."""
    return min(5.0, max(0.05, timeout_s / 6))


class HeartbeatWatchdog:
    """A rank's heartbeat publisher and the checker of every other rank's heartbeat.

    Args:
        store: a c10d store every rank can reach (wrapped in a prefix of its own).
        rank, world_size: this rank and the number of ranks that beat.
        timeout_s: seconds of silence after which a rank is reported.
        on_hang: called once, from the watchdog thread, with the :class:`HangReport`.
        interval_s: heartbeat period (default :func:`interval_for`).
        clock: the monotonic clock (a test may pass its own).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_hang: Callable[[HangReport], None],
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefix: str = "lightning_zero/heartbeat",
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"hang timeout must be positive seconds, got {timeout_s!r} (0 or None disables it).")
        self.store = dist.PrefixStore(prefix, store)
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.on_hang = on_hang
        self.interval_s = interval_for(timeout_s) if interval_s is None else interval_s
        self.clock = clock
        self.step, self.operation = 0, "setup"
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, str] = {}
        self._changed: dict[int, float] = {}
        self._last_answer = clock()
        self._error: str | None = None  # the last store error, if any
        self._lock = threading.Lock()
        self.report: HangReport | None = None  # set once a hang was found

    def mark(self, operation: str, step: int | None = None) -> None:
        """Record what this rank is doing now (published with the next beat)."""
        self.operation = operation
        if step is not None:
            self.step = step

    def start(self) -> HeartbeatWatchdog:
        """Publish the first beat and start the daemon thread."""
        now = self.clock()
        self._last_answer = now
        self._changed = {r: now for r in range(self.world_size)}
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"lightning-zero-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        # the store calls above may block (its host hung): a second thread watches their answers
        threading.Thread(target=self._watch_store, name=f"lightning-zero-store-watch-{self.rank}", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop the thread and publish ``done`` (this rank is no longer watched by the others)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5.0)
        self._thread = None
        with contextlib.suppress(Exception):  # the store may be gone at teardown: nobody to tell then
            self.store.set(_KEY.format(self.rank), DONE)

    def beat(self) -> None:
        """Publish this rank's beat counter, step and operation."""
        self._beats += 1
        self.store.set(_KEY.format(self.rank), f"{self._beats} {self.step} {self.operation}")

    def check(self) -> HangReport | None:
        """Read every rank's beat; the report of the ranks silent for ``timeout_s`` (or ``None``).
        A report another rank published first wins (every survivor names the same ranks)."""
        if self.store.check([_FOUND]):
            found = self.store.get(_FOUND).decode()
            self._last_answer = self.clock()
            return self._report([_silent_from_text(line) for line in found.splitlines()])
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [_KEY.format(r) for r in others]
        if keys and not self.store.check(keys):  # some rank has not beaten yet: get() would wait for it
            others = [r for r, k in zip(others, keys) if self.store.check([k])]
            keys = [_KEY.format(r) for r in others]
        values = self.store.multi_get(keys) if keys else []
        now = self.clock()
        self._last_answer = now
        silent = [_silent(r, now - self._changed[r], "") for r in range(self.world_size)
                  if r != self.rank and r not in others and r not in self._seen
                  and now - self._changed[r] >= self.timeout_s]
        for r, raw in zip(others, values):
            value = raw.decode() if isinstance(raw, bytes) else str(raw)
            if value != self._seen.get(r):
                self._seen[r], self._changed[r] = value, now
                continue
            if value == DONE or now - self._changed[r] < self.timeout_s:
                continue
            silent.append(_silent(r, now - self._changed[r], value))
        return self._report(silent) if silent else None

    def _report(self, silent: Sequence[SilentRank], store_failure: str | None = None) -> HangReport:
        return HangReport(self.rank, self.step, self.operation, tuple(silent), self.timeout_s, store_failure)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
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
                self._found(self._report((), self._error or "no answer"))
                return

    def _found(self, report: HangReport) -> None:
        with self._lock:
            if self.report is not None or self._stop.is_set():
                return
            self.report = report
        if report.silent:
            with contextlib.suppress(Exception):  # tell the others (they may not have noticed yet)
                self.store.compare_set(_FOUND, "", "\n".join(_silent_to_text(s) for s in report.silent))
        self.on_hang(report)


def _silent_to_text(s: SilentRank) -> str:
    return f"{s.rank} {s.silent_s:.1f} {-1 if s.step is None else s.step} {s.operation or ''}"


def _silent_from_text(line: str) -> SilentRank:
    rank, silent_s, step, operation = (line.split(" ", 3) + [""])[:4]
    return SilentRank(int(rank), float(silent_s), None if step == "-1" else int(step), operation or None)


def _silent(rank: int, silent_s: float, value: str) -> SilentRank:
    """Parse ``"<beats> <step> <operation>"``; a key that never appeared gives ``None`` fields."""
    parts = value.split(" ", 2)
    if len(parts) == 3 and parts[1].lstrip("-").isdigit():
        return SilentRank(rank, silent_s, int(parts[1]), parts[2])
    return SilentRank(rank, silent_s, None, None)
