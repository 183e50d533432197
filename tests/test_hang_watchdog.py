"""The hang watchdog (lightning_zero/core/heartbeat.py, hang_watchdog.py): its logic in one process on an
in-memory store with a fake clock, and fault injection on real rank processes: a SIGSTOPped rank is named
by every other rank, which exit long before the collective timeout; a rank 0 busy in a long checkpoint
save does not trip it; a SIGKILLed rank under torchrun ends the job with a summary naming it, and the run
resumes from ``ckpt_path="last"`` exactly as if uninterrupted."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from lightning_zero.core.heartbeat import HangReport, HeartbeatWatchdog
from lightning_zero.hang_watchdog import HANG_EXIT_CODE
from tests.models import TinyTransformer

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "fault_script.py")


# ---------------------------------------------------------------------------------------------- logic
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pair(timeout_s: float = 10.0) -> tuple[Clock, list[HeartbeatWatchdog], list[HangReport]]:
    store, clock, reports = dist.HashStore(), Clock(), []
    dogs = [HeartbeatWatchdog(store, r, 3, timeout_s, reports.append, clock=clock) for r in range(3)]
    for d in dogs:
        d._changed = {r: clock.now for r in range(3)}  # what start() does, without the thread
    return clock, dogs, reports


def test_a_silent_rank_is_named_with_its_step_and_operation_after_the_timeout_only() -> None:
    clock, dogs, _ = _pair()
    dogs[1].mark("backward (gradient reduction)", 7)
    for d in dogs:
        d.beat()
    assert dogs[0].check() is None
    clock.now += 6
    dogs[0].mark("optimizer step", 8)
    dogs[0].beat(), dogs[2].beat()  # rank 1 stays silent from here on
    assert dogs[0].check() is None and dogs[2].check() is None
    clock.now += 6  # 12 s since rank 1's counter last changed, 6 s for rank 2
    report = dogs[0].check()
    assert report is not None and [s.rank for s in report.silent] == [1]
    silent = report.silent[0]
    assert (silent.step, silent.operation) == (7, "backward (gradient reduction)") and silent.silent_s == 12
    text = report.message()
    assert "rank 1" in text and "step 7" in text and "'backward (gradient reduction)'" in text
    assert "hang detected on rank 0 at step 8 in 'optimizer step'" in text and "hang_timeout_s=10" in text


def test_done_ranks_are_not_watched_and_a_rank_never_seen_is_named() -> None:
    clock, dogs, _ = _pair()
    dogs[0].beat(), dogs[1].beat()  # rank 2 never beats
    assert dogs[0].check() is None
    dogs[1].stop()  # finished normally: publishes "done"
    clock.now += 11
    dogs[0].beat()
    report = dogs[0].check()
    assert report is not None and [(s.rank, s.step) for s in report.silent] == [(2, None)]
    assert "last seen never" in report.message()


def test_the_first_report_is_shared_so_every_survivor_names_the_same_rank() -> None:
    clock, dogs, reports = _pair()
    for d in dogs:
        d.beat()
    dogs[0].check(), dogs[2].check()
    clock.now += 11
    dogs[0].beat(), dogs[2].beat()
    dogs[0]._found(dogs[0].check())  # rank 0 finds rank 1 silent and publishes that
    dogs[2]._changed[1] = clock.now  # rank 2's own view: rank 1 changed just now (it would not report yet)
    shared = dogs[2].check()
    assert [s.rank for s in reports[0].silent] == [1]
    assert shared is not None and [(s.rank, s.step) for s in shared.silent] == [(1, 0)]


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


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_every_other_rank_which_exit(tmp_path: Path) -> None:
    hang_timeout = 5.0
    procs = _launch("stop", 3, tmp_path, HANG_TIMEOUT_S=str(hang_timeout))
    try:
        stopped_at = _wait_for(tmp_path / "rank1.log", "STOPPING rank 1", 240)
        ended = _reap([procs[0], procs[2]], 100)
    finally:
        for p in procs:
            p.kill()
    for rank, end in ((0, ended[0]), (2, ended[1])):
        log = (tmp_path / f"rank{rank}.log").read_text(errors="replace")
        assert end is not None, f"rank {rank} still running:\n{log[-3000:]}"
        # well before the 120 s collective timeout (the margin is for a loaded 2-core machine)
        assert end - stopped_at < hang_timeout + 45, (rank, end - stopped_at)
        assert procs[rank].returncode == HANG_EXIT_CODE, log[-3000:]
        assert "no heartbeat from rank 1" in log and "at step 3" in log, log[-3000:]


@pytest.mark.slow
def test_a_long_save_on_rank_0_does_not_trip_the_watchdog(tmp_path: Path) -> None:
    # each save takes 2.5 hang timeouts on rank 0 while rank 1 waits for it in a collective
    procs = _launch("slowsave", 2, tmp_path, HANG_TIMEOUT_S="3", SLOW_SAVE_S="7.5")
    try:
        ended = _reap(procs, 300)
    finally:
        for p in procs:
            p.kill()
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
    assert all(e is not None for e in ended), logs[0][-2000:]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "SLOW SAVE done at step 2" in logs[0] and "DONE rank 1" in logs[1]
    assert "hang detected" not in logs[0] + logs[1]


def resume_body(root: str) -> dict[str, Any]:
    from tests.test_checkpoints import _fit, _saver

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
    results = gloo_pool.run("tests.test_hang_watchdog:resume_body", root=str(tmp_path))
    for r in results:
        assert r["step"] == 8 and len(r["resumed"]) == 4, r
        assert r["resumed"] == r["full"][4:], r  # bitwise: the resumed steps are the uninterrupted ones
