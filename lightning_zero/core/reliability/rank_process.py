"""Each rank's process as the hang watchdog publishes it (where it runs, its pid, when it started), and the end of
a rank found silent where the reporting rank can reach it (Note [ending a silent rank]).

Note [ending a silent rank]
    A rank stopped with SIGSTOP (or frozen) is named by every live rank after ``hang_timeout_s``, which then exit.
    The job still waited for the stopped one: torchrun (the CLI's launcher, and torchrun started by hand) and
    ``torch.multiprocessing``'s spawn (``Trainer(strategy="zero_stage_2_spawn")``) send SIGTERM, which a stopped
    process does not act on, and SIGKILL only 30 s later (76 s from the stop to the end of the job on a loaded
    machine); Lightning's default launcher (``Trainer(devices=N)`` re-running the script) left a stopped rank 1
    behind when rank 0 exited, and a stopped rank 0 (which hosts the store there: the others report the store
    silent) stayed stopped for good. So each rank publishes its process once,
    at the watchdog's start: ``<kernel boot id>/<pid namespace> <pid> <start time>``. The finding carries the
    silent ranks' entries, and a reporting rank that runs in the same kernel and pid namespace (so that the pid
    means the same process) ends each of them with SIGKILL, which a stopped process does act on, once its start
    time shows that the pid still is that rank (not a process that reused the number); when the store itself
    stops answering, the other ranks end rank 0 if they see it stopped (its entry read while the store answered).
    Every launcher then sees all its ranks gone and ends the job at once. A silent rank on another host is left to
    its own node's ranks, or its launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from lightning_zero.core.reliability.hang_finding import SilentRank


def _where() -> str:
    """This kernel's boot and this process's pid namespace: where a pid names one process."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    return f"{boot or os.uname().nodename}/{namespace}"


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, ``/proc/<pid>/stat``), ``None`` when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before ")" may hold spaces


def process_text(pid: int | None = None) -> str:
    """``<where> <pid> <start time>`` of this process (or ``pid``'s, in this process's place), as published."""
    pid = os.getpid() if pid is None else pid
    return f"{_where()} {pid} {_started(pid)}"


def _same_process(text: str | None) -> int | None:
    """The pid of a published process that still is that process and runs where this one does, else ``None``."""
    parts = (text or "").split()
    if len(parts) != 3 or parts[0] != _where() or not parts[1].isdigit():
        return None
    pid = int(parts[1])
    return pid if pid != os.getpid() and _started(pid) == parts[2] else None  # else gone, or the number reused


def is_stopped(text: str | None) -> bool:
    """Whether the published process is stopped (SIGSTOP, a debugger), where this process can see it."""
    pid = _same_process(text)
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state in ("T", "t")


def end_silent_ranks(silent: Iterable[SilentRank]) -> list[SilentRank]:
    """SIGKILL each silent rank this process can reach (Note [ending a silent rank]); the ones it ended."""
    ended = []
    for rank in silent:
        pid = _same_process(rank.process)
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        ended.append(rank)
    return ended
