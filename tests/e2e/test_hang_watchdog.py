"""The hang watchdog (lightning_zero/core/reliability/heartbeat.py, hang_watchdog.py): its logic in one process on an
in-memory store with a fake clock, and fault injection on real rank processes: a SIGSTOPped rank is named
by every other rank within 60 s at the default settings; a collective called on one rank only is named,
with the collectives each side waits in, by every rank; a rank 0 busy in a long checkpoint save does not trip
it; a SIGKILLed rank under torchrun ends the job with a summary naming it, and the run
resumes from ``ckpt_path="last"`` exactly as if uninterrupted."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from docs.regenerate import check_test_quote
from lightning_zero import ZeroStrategy
from lightning_zero.core.reliability.heartbeat import HangReport, HeartbeatWatchdog
from lightning_zero.core.reliability.progress_record import ProgressRecord, parse_progress
from lightning_zero.core.reliability.rank_process import end_silent_ranks, is_stopped, process_text
from lightning_zero.reliability.hang_watchdog import HANG_EXIT_CODE, STUCK_EXIT_CODE
from tests.models import TinyTransformer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "tests" / "fault_script.py")


# ---------------------------------------------------------------------------------------------- logic
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingStore:
    """An in-memory store with the c10d calls the watchdog makes, counting the keys it reads."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.reads = 0

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self.reads += 1
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.reads += len(keys)
        return [self.data[k] for k in keys]

    def check(self, keys: list[str]) -> bool:
        self.reads += len(keys)
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.reads += 1
        if self.data.get(key, b"").decode() == expected:
            self.data[key] = desired.encode()
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


def _ranks(world: int = 3, timeout_s: float = 10.0) -> tuple[Clock, CountingStore, list[HeartbeatWatchdog],
                                                              list[HangReport]]:
    store, clock, reports = CountingStore(), Clock(), []
    dogs = [HeartbeatWatchdog(store, r, world, timeout_s, reports.append, interval_s=1.0, clock=clock)
            for r in range(world)]
    return clock, store, dogs, reports


def _round(dogs: list[HeartbeatWatchdog], clock: Clock, seconds: float = 1.0,
           skip: tuple[int, ...] = ()) -> list[HangReport | None]:
    """One interval: every rank not in ``skip`` beats, then checks (rank 0 first: it publishes the verdict)."""
    clock.now += seconds
    live = [d for d in dogs if d.rank not in skip]
    for d in live:
        d.beat()
    return [d.check() for d in live]


def test_a_silent_rank_is_named_by_every_rank_with_its_step_and_phase_after_the_timeout_only() -> None:
    clock, _, dogs, _ = _ranks()
    dogs[1].mark("backward (gradient reduction)", 7)
    for _ in range(5):
        assert _round(dogs, clock) == [None, None, None]
    dogs[0].mark("optimizer step", 8)
    for _ in range(9):  # rank 1 silent from here on: 9 s, under the 10 s timeout
        assert _round(dogs, clock, skip=(1,)) == [None, None]
    found = _round(dogs, clock, skip=(1,))
    assert all(r is not None and r.kind == "silent" for r in found), found
    assert found[0].text == found[1].text and [s.rank for s in found[0].silent] == [1]
    silent = found[0].silent[0]
    assert (silent.step, silent.operation, silent.silent_s) == (7, "backward (gradient reduction)", 10.0)
    assert "no heartbeat from rank 1" in found[1].message() and "hang_timeout_s=10" in found[1].text
    assert found[1].exit_code == HANG_EXIT_CODE == 75 and "rank 2 reporting" in found[1].message()


def test_rank_0_the_aggregator_silent_is_named_by_every_other_rank_alike() -> None:
    clock, _, dogs, _ = _ranks(4)
    dogs[0].mark("training_step", 5)
    _round(dogs, clock)
    for _ in range(9):
        assert _round(dogs, clock, skip=(0,)) == [None, None, None]
    found = _round(dogs, clock, skip=(0,))
    assert all(r is not None and r.kind == "silent" for r in found), found
    assert {r.text for r in found} == {found[0].text} and "no heartbeat from rank 0" in found[0].text
    assert (found[0].silent[0].step, found[0].silent[0].operation) == (5, "training_step")


def test_rank_0_publishing_again_while_another_rank_names_it_is_not_named() -> None:
    clock, store, dogs, _ = _ranks()
    _round(dogs, clock)
    for _ in range(9):
        _round(dogs, clock, skip=(0,))
    clock.now += 1
    swap = store.compare_set

    def late(key: str, expected: str, desired: str) -> bytes:  # rank 0 wakes up just before rank 1's swap
        store.compare_set = swap  # type: ignore[method-assign]
        dogs[0].beat(), dogs[0].check()
        return swap(key, expected, desired)

    store.compare_set = late  # type: ignore[method-assign]
    assert dogs[1].check() is None and dogs[2].check() is None


def test_done_ranks_are_not_watched_and_a_rank_never_seen_is_named() -> None:
    clock, _, dogs, _ = _ranks()
    _round(dogs, clock, skip=(2,))  # rank 2 never beats
    dogs[1].stop()  # finished normally: publishes "done"
    for _ in range(8):  # 9 s since the watchdogs were made
        assert _round(dogs, clock, skip=(1, 2)) == [None]
    report = _round(dogs, clock, skip=(1, 2))[0]
    assert report is not None and [(s.rank, s.step) for s in report.silent] == [(2, None)]
    assert "last seen never" in report.text


def test_a_silent_ranks_finding_carries_its_process_and_a_reporting_rank_where_it_runs_ends_it() -> None:
    """Note [ending a silent rank]: the finding names the silent rank's pid, every rank's copy carries its process,
    and a rank where that pid means the same process ends it with SIGKILL (which a stopped process acts on);
    a pid that now belongs to another process (another start time) or one of another host is left alone."""
    clock, store, dogs, _ = _ranks()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a stand-in for rank 1
    try:
        os.kill(child.pid, signal.SIGSTOP)
        store.set(dogs[1].key("process/1"), process_text(child.pid))  # what rank 1 publishes at its start
        _round(dogs, clock)
        found = [None]
        for _ in range(10):
            found = _round(dogs, clock, skip=(1,))
        assert all(r is not None and r.kind == "silent" for r in found), found
        mine, theirs = found[0].silent[0], found[1].silent[0]
        assert mine == theirs and mine.pid == child.pid and f"rank 1 (pid {child.pid}, silent" in found[0].text
        assert is_stopped(mine.process)
        where, pid, started = mine.process.split()
        reused = replace(mine, process=f"{where} {pid} {int(started) + 1}")  # the number, another process
        elsewhere = replace(mine, process=f"another-host/pid:[1] {pid} {started}")
        assert end_silent_ranks([reused, elsewhere]) == [] and child.poll() is None
        assert end_silent_ranks([mine]) == [mine] and child.wait(10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def _diverged(dogs: list[HeartbeatWatchdog]) -> None:
    """Ranks 0 and 2 wait in collective #4 (an all_reduce of the backward of step 3); rank 1 is in
    user code in training_step at step 3, after collective #3 (it called a collective of its own)."""
    for d in dogs:
        for _ in range(3):
            with d.record.collective("all_gather"):
                pass
        d.mark("training_step", 3)
    for d in (dogs[0], dogs[2]):
        d.mark("backward (gradient reduction)", 3)
        d.record.collective("all_reduce").__enter__()


def test_live_ranks_in_different_collectives_are_named_by_every_rank_one_interval_before_the_timeout() -> None:
    clock, _, dogs, _ = _ranks()
    _diverged(dogs)
    for _ in range(8):  # everyone keeps beating; progress stopped 8 s ago
        assert _round(dogs, clock) == [None, None, None]
    found = _round(dogs, clock)
    assert all(r is not None and r.kind == "stuck" for r in found), found
    assert {r.text for r in found} == {found[0].text} and found[0].exit_code == STUCK_EXIT_CODE == 76
    text = found[0].text
    assert "ranks 0, 2: waiting in the strategy's collective #4 all_reduce (step 3, 'backward (gradient " in text
    assert "rank 1: outside the strategy, in user code at step 3 ('training_step'), after collective #3" in text
    assert "Rank 1: behind, in user code ('training_step'): not yet at the strategy's collective #4" in text
    assert "Check the code rank 1 ran at step 3: a collective called on some ranks only" in text
    # decided one interval early (Note [hang watchdog]): the text names the limit, and the measured stall as such
    assert text.startswith("every rank is alive but none made progress for zero.hang_timeout_s=10 s (measured "
                           "9.0 s, from reports up to one 1 s watchdog interval old):"), text


def test_a_long_phase_on_one_rank_is_never_reported_stuck_and_the_clock_restarts_after_it() -> None:
    clock, _, dogs, _ = _ranks()
    for d in dogs[1:]:  # (not in a long phase themselves)
        d.mark("optimizer step", 4)
        d.record.collective("barrier(Trainer.save_checkpoint)").__enter__()
    dogs[0].mark("checkpoint save", 4, long_phase=True)  # rank 0 saves for 3 timeouts; the others wait
    for _ in range(30):
        assert _round(dogs, clock) == [None, None, None]
    dogs[0].mark("between steps", 4)  # the save ended, but rank 0 now stalls in user code
    for _ in range(8):
        assert _round(dogs, clock) == [None, None, None]
    assert all(r is not None and r.kind == "stuck" for r in _round(dogs, clock))


def test_a_stall_shorter_than_three_of_the_longest_steps_is_not_reported() -> None:
    clock, _, dogs, _ = _ranks()
    _diverged(dogs)
    dogs[2].record.step_s = 5.0  # a 5 s step was seen: 15 s, not 10 (less the one interval, Note [hang watchdog])
    for _ in range(13):
        assert _round(dogs, clock) == [None, None, None]
    found = _round(dogs, clock)
    assert all(r is not None and r.kind == "stuck" for r in found)
    assert "none made progress for 3 x the longest training step (15 s; zero.hang_timeout_s=10 s)" in found[0].text


def test_ranks_all_in_user_code_are_not_reported() -> None:
    clock, _, dogs, _ = _ranks()
    for d in dogs:
        d.mark("training_step", 3)  # a long forward everywhere looks like this
    for _ in range(30):
        assert _round(dogs, clock) == [None, None, None]


@pytest.mark.parametrize("world", [1024, 4096])
def test_store_reads_per_interval_grow_linearly_with_the_ranks(world: int) -> None:
    clock, store, dogs, _ = _ranks(world, timeout_s=45.0)
    _round(dogs, clock)  # the first round also checks which keys exist
    store.reads = 0
    assert _round(dogs, clock) == [None] * world
    per_interval = store.reads
    print(f"N={world}: {per_interval} store reads per interval (every rank reading every other: {world * (world - 1)})")
    # rank 0 reads N - 1 beats and swaps its verdict in (compare_set: one read), every other rank the verdict
    assert per_interval == 2 * (world - 1) + 1
    assert per_interval < world * (world - 1) / 500


def test_a_store_that_stops_answering_is_reported() -> None:
    reports: list[HangReport] = []
    dog = HeartbeatWatchdog(dist.HashStore(), 0, 2, 0.3, reports.append).start()
    try:
        deadline = time.monotonic() + 10
        dog.store = None  # type: ignore[assignment]  # every store call now raises
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog._stop.set()
    assert reports and reports[0].store_failure is not None
    assert "rendezvous store did not answer" in reports[0].message()


def test_the_progress_record_numbers_collectives_and_marks_waits() -> None:
    clock = Clock()
    record = ProgressRecord(clock)
    with record.collective("all_reduce"):
        inside = parse_progress(record.to_text(1))
    seq = record.issued("all_gather")
    clock.now += 2
    with record.waiting(seq, "all_gather"):
        waiting = parse_progress(record.to_text(2))
    after = parse_progress(record.to_text(3))
    assert inside is not None and (inside.seq, inside.waiting_seq, inside.kind) == (1, 1, "all_reduce")
    assert waiting is not None and (waiting.seq, waiting.waiting_seq, waiting.age_s) == (2, 2, 0.0)
    assert after is not None and not after.inside and "after collective #2 all_gather" in after.where()


def test_hang_timeout_is_validated_and_configurable() -> None:
    assert ZeroStrategy(hang_timeout_s=7).zero_config.hang_timeout_s == 7
    with pytest.raises(ValueError, match="hang_timeout_s"):
        ZeroStrategy(hang_timeout_s=-1)


# ---------------------------------------------------------------------------------------------- fault injection
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, world: int, root: Path, **env: str) -> list[subprocess.Popen]:
    port = str(_free_port())
    procs = []
    for r in range(world):
        rank_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world),
                    "RANK": str(r), "LOCAL_RANK": str(r), "NODE_RANK": "0", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(REPO), "PL_DISABLE_FORK": "1", **env}
        out = open(root / f"rank{r}.log", "w")  # noqa: SIM115 - the child writes it
        procs.append(subprocess.Popen([sys.executable, SCRIPT, mode, str(root)], env=rank_env, stdout=out,
                                      stderr=subprocess.STDOUT))
    return procs


def _wait_for(path: Path, text: str, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {timeout_s} s:\n{path.read_text(errors='replace')[-3000:]}")


def _reap(procs: list[subprocess.Popen], timeout_s: float) -> list[float | None]:
    """Each process's exit time (``None``: still running after ``timeout_s``)."""
    deadline, ended = time.monotonic() + timeout_s, [None] * len(procs)
    while time.monotonic() < deadline and any(e is None for e in ended):
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.1)
    return ended


_STOPPED = "test_a_stopped_rank_is_named_within_60_s_at_default_settings_by_every_other_rank"


def _run_stopped_at_default_settings(root: Path) -> dict[str, Any]:
    """Three ranks at the default hang_timeout_s (45 s), rank 1 stopped: when it stopped and when each ended."""
    procs = _launch("stop", 3, root)
    try:
        stopped_at = _wait_for(root / "rank1.log", "STOPPING rank 1", 240)
        ended = _reap(procs, 120)
    finally:
        for p in procs:
            p.kill()
    return {"after_stop": [None if e is None else e - stopped_at for e in ended],
            "codes": [p.returncode for p in procs],
            "logs": [(root / f"rank{rank}.log").read_text(errors="replace") for rank in range(3)], "root": root}


@pytest.mark.slow
@pytest.mark.lane(run=_run_stopped_at_default_settings, sleeps=True)  # tests/lane.py
def test_a_stopped_rank_is_named_within_60_s_at_default_settings_by_every_other_rank(
        lane_result: dict[str, Any]) -> None:
    after_stop, codes, logs = lane_result["after_stop"], lane_result["codes"], lane_result["logs"]
    # the stopped rank too: a reporting rank ended it (Note [ending a silent rank]), so the job ends with them
    assert after_stop[1] is not None and codes[1] == -signal.SIGKILL, codes[1]
    print(f"the stopped rank 1 was ended {after_stop[1]:.1f} s after the stop")
    assert after_stop[1] < 60
    for rank in (0, 2):
        log = logs[rank]
        assert after_stop[rank] is not None, f"rank {rank} still running:\n{log[-3000:]}"
        assert after_stop[rank] < 60, (rank, after_stop[rank])  # named and exited (the collective timeout: 120 s)
        assert codes[rank] == HANG_EXIT_CODE, log[-3000:]
        # its last beat (every 2 s at the default) may predate steps 0-3 of this tiny model
        assert re.search(r"no heartbeat from rank 1 \(pid \d+, silent \d+ s, last seen at step [0-3] in '", log), \
            log[-3000:]
        print(f"rank {rank} named rank 1 and exited {after_stop[rank]:.1f} s after the stop")
    test = f"tests/e2e/test_hang_watchdog.py::{_STOPPED}"
    issues = check_test_quote("docs/reliability.md", test, "\n".join((logs[0], logs[2])),
                              lane_result["root"])  # the finding it quotes
    assert not issues, "docs/reliability.md quotes this finding: refresh it (docs/regenerate.py)\n" + "\n".join(issues)


def _state(pid: int) -> str | None:
    """The process's state letter (``T``: stopped, ``Z``: exited, not reaped), ``None`` when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _run_stopped_under_trainers_launcher(root: Path, stopped: int) -> dict[str, Any]:
    """``Trainer(devices=2)``'s own launcher, rank ``stopped`` stopped at hang_timeout_s=4: how long after the stop
    both processes were gone, their states then, the launcher's exit code and the log."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env.update(PYTHONPATH=str(REPO), PL_DISABLE_FORK="1", OMP_NUM_THREADS="1", HANG_TIMEOUT_S=str(_LAUNCHER_HANG_S),
               STOP_RANK=str(stopped))
    log = root / "ranks.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, SCRIPT, "launch_stop", str(root)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        stopped_at = _wait_for(log, f"STOPPING rank {stopped}", 240)
        pids = [int(re.search(rf"RANK {r} pid (\d+)", log.read_text()).group(1)) for r in range(2)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_state(p) not in (None, "Z") for p in pids):
            time.sleep(0.1)
        ended = time.monotonic()
        left = [_state(p) for p in pids]
        try:
            code: int | None = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None  # still running: the test names it
    finally:
        proc.kill()
        for pid in pids:  # this run's descendants: never left stopped
            if _state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)
    return {"after_stop": ended - stopped_at, "left": left, "pids": pids, "code": code,
            "text": log.read_text(errors="replace")}


_LAUNCHER_HANG_S = 4.0


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [1, 0])
@pytest.mark.lane(run=_run_stopped_under_trainers_launcher)  # Note [background lane] in tests/lane.py
def test_a_stopped_rank_under_trainers_own_launcher_is_ended_with_the_job(lane_result: dict[str, Any],
                                                                          stopped: int) -> None:
    """``Trainer(devices=2)``: Lightning's launcher re-runs the script as rank 1, a child of rank 0. A stopped rank 1
    (SIGSTOP) was named by rank 0, which exited, and left behind stopped for good; a stopped rank 0 (which hosts the
    store there: rank 1 reports the store silent) kept the job stopped for good (issue 41, 11). Now the reporting
    rank ends the stopped one (Note [ending a silent rank]) and both processes are gone right after the finding."""
    left, text, after_stop = lane_result["left"], lane_result["text"], lane_result["after_stop"]
    print(f"rank {1 - stopped} ended rank {stopped}; both gone {after_stop:.1f} s after the stop: {left}")
    assert all(state in (None, "Z") for state in left), (left, text[-3000:])  # exited or killed, none stopped
    assert after_stop < _LAUNCHER_HANG_S + 10, (after_stop, text[-3000:])
    assert f"ended the silent rank {stopped} (pid {lane_result['pids'][stopped]}) with SIGKILL" in text, text[-3000:]
    assert lane_result["code"] == (HANG_EXIT_CODE if stopped == 1 else -signal.SIGKILL), text[-3000:]


def _extra_collective_at(log: str) -> float:
    return float(log.split("EXTRA all_reduce on rank 1 at step 3 t=")[1].split()[0])


_EXTRA_HANG_S = 4.0  # interval_for(4) = 0.5 s


def _run_extra_collective(root: Path) -> dict[str, Any]:
    """Rank 1 enters one all_reduce more than rank 0 at step 3: each rank's exit instant (``None``: still running
    after 240 s), exit code and log."""
    procs = _launch("diverge", 2, root, HANG_TIMEOUT_S=str(_EXTRA_HANG_S))
    try:
        ended = _reap(procs, 240)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {"ended": ended, "codes": [p.returncode for p in procs],
            "logs": [(root / f"rank{r}.log").read_text(errors="replace") for r in range(2)]}


@pytest.mark.slow
@pytest.mark.lane(run=_run_extra_collective, sleeps=True)  # Note [background lane] in tests/lane.py
def test_a_collective_on_one_rank_only_ends_the_job_on_every_rank_naming_the_rank_and_both_collectives(
        lane_result: dict[str, Any]) -> None:
    hang_timeout, ended, logs = _EXTRA_HANG_S, lane_result["ended"], lane_result["logs"]
    assert all(e is not None for e in ended), logs[0][-3000:] + logs[1][-3000:]
    stuck_at = _extra_collective_at(logs[1])
    findings = []
    for rank, log in enumerate(logs):
        assert lane_result["codes"][rank] == STUCK_EXIT_CODE, log[-3000:]
        # hang_timeout_s + one interval (Note [hang watchdog]), plus 1.5 s: the 0.1 s reaping poll, printing and
        # os._exit of a process on a loaded 2-core machine, and the acknowledgement wait's 0.05 s polls
        assert ended[rank] - stuck_at < hang_timeout + 0.5 + 1.5, (rank, ended[rank] - stuck_at)
        print(f"rank {rank} reported and exited {ended[rank] - stuck_at:.1f} s after the extra collective")
        finding = log.split(f"hang detected (rank {rank} reporting, exit code 76): ")[1].split("zero.timeout_s)")[0]
        findings.append(finding)
        assert "rank 0: waiting in the strategy's collective #" in finding, finding
        assert "rank 1: outside the strategy, in user code at step 3 ('training_step')" in finding, finding
        assert "Rank 1: behind" in finding and "Check the code rank 1 ran at step 3" in finding, finding
    assert findings[0] == findings[1]  # every rank reports the same finding


def _run_slow_save(root: Path) -> dict[str, Any]:
    """Rank 0 saves for 9 s (three hang timeouts of 3 s) while rank 1 waits in a barrier: exit codes and logs."""
    procs = _launch("slowsave", 2, root, HANG_TIMEOUT_S="3", SLOW_SAVE_S="9")
    try:
        ended = _reap(procs, 300)
    finally:
        for p in procs:
            p.kill()
    return {"ended": [e is not None for e in ended], "codes": [p.returncode for p in procs],
            "logs": [(root / f"rank{r}.log").read_text(errors="replace") for r in range(2)]}


@pytest.mark.slow
@pytest.mark.lane(run=_run_slow_save)  # Note [background lane] in tests/lane.py
def test_a_save_of_three_hang_timeouts_on_rank_0_while_rank_1_waits_in_a_barrier_is_no_hang(
        lane_result: dict[str, Any]) -> None:
    logs = lane_result["logs"]
    assert all(lane_result["ended"]), logs[0][-2000:]
    assert lane_result["codes"] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "SLOW SAVE done at step 2; rank 1 waiting in the strategy's collective" in logs[0], logs[0][-3000:]
    assert "barrier" in logs[0].split("SLOW SAVE done at step 2")[1].splitlines()[0], logs[0][-3000:]
    assert "DONE rank 1" in logs[1] and "hang detected" not in logs[0] + logs[1]


def numbering_body() -> dict[str, Any]:
    from lightning_zero.core.reliability.progress_record import RECORD
    from tests.e2e.test_checkpoints import _fit

    kinds: set[str] = set()
    numbered = RECORD.collective
    RECORD.collective = lambda kind: (kinds.add(kind), numbered(kind))[1]  # type: ignore[method-assign]
    try:
        _fit(TinyTransformer("adamw"), ZeroStrategy(stage=3, hang_timeout_s=30), max_steps=3)
    finally:
        del RECORD.collective
    return {"seq": RECORD.seq, "waiting": RECORD.waiting_seq, "kinds": sorted(kinds)}


@pytest.mark.distributed
def test_every_rank_numbers_the_strategys_collectives_alike(gloo_pool) -> None:
    results = gloo_pool.run("tests.e2e.test_hang_watchdog:numbering_body")
    assert results[0]["seq"] > 10 and results[0]["seq"] == results[1]["seq"], results
    assert results[0]["waiting"] == 0 and results[0]["kinds"] == results[1]["kinds"], results
    # stage 3 gathers; on gloo its gradients go to their owners by send/recv (Note [owner exchange])
    assert {"all_gather", "send/recv (gradient exchange)"} <= set(results[0]["kinds"]), results
    assert any(k.startswith("barrier") for k in results[0]["kinds"]), results  # Lightning's own barrier


def resume_body(root: str) -> dict[str, Any]:
    from tests.e2e.test_checkpoints import _fit, _saver

    full = TinyTransformer("adamw")
    _fit(full, ZeroStrategy(stage=2), max_steps=8)
    resumed = TinyTransformer("adamw")
    trainer = _fit(resumed, ZeroStrategy(stage=2), max_steps=8, ckpt_path="last",
                   callbacks=[_saver(root, every=100, save_last=True)])
    return {"full": full.losses, "resumed": resumed.losses, "step": trainer.global_step}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_rank_ends_the_job_with_a_summary_and_last_resumes_exactly(gloo_pool, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, "kill",
           str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PL_DISABLE_FORK": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "KILLING rank 1 at step 5" in out, out[-3000:]
    # torchrun's failure summary names the rank and the signal
    assert "rank      : 1" in out or "rank: 1" in out, out[-3000:]
    assert "Signal 9 (SIGKILL)" in out, out[-3000:]
    results = gloo_pool.run("tests.e2e.test_hang_watchdog:resume_body", root=str(tmp_path))
    for r in results:
        assert r["step"] == 8 and len(r["resumed"]) == 4, r
        assert r["resumed"] == r["full"][4:], r  # bitwise: the resumed steps are the uninterrupted ones
