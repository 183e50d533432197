"""The launcher's reading of torchrun's failure report (no launch needed)."""

from __future__ import annotations

from pathlib import Path

from lightning_zero.config.console import RankConsole, failure_summary


def _failure(idx: int, rank: int, code: int, traceback: str) -> str:
    return "\n".join([f"[{idx}]:", "  time      : 2026-11-23_07:00:00", "  host      : vm",
                      f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: 123)",
                      "  error_file: <N/A>", f"  traceback : {traceback}"])


def _report(root: str, others: list[str]) -> str:
    # the layout of torch.distributed.elastic's failure report
    line, section = "=" * 60, "-" * 60
    return "\n".join(["", line, "train.py FAILED", section, "Failures:", *(others or ["  <NO_OTHER_FAILURES>"]),
                      section, "Root Cause (first observed failure):", root, line, ""])


def _read(tmp_path: Path, report: str) -> RankConsole:
    shown: list[str] = []
    console = RankConsole(tmp_path / "train.log", echo=shown.append)
    for line in report.splitlines(keepends=True):
        console.feed(line)
    console.close()
    assert "".join(shown) == report  # the report itself is shown as it is
    return console


def test_the_rank_torchrun_stopped_is_not_blamed_for_the_one_that_was_killed(tmp_path: Path) -> None:
    # both failures within one second: torchrun's tie-break names rank 0, which it stopped itself
    report = _report(_failure(0, 0, -15, "Signal 15 (SIGTERM) received by PID 1"),
                     [_failure(1, 1, -9, "Signal 9 (SIGKILL) received by PID 2")])
    failed = _read(tmp_path, report).first_failure()
    assert failed is not None and (failed.rank, failed.signal_name, failed.traceback) == (1, "SIGKILL", False)
    text = failure_summary(failed, 2, tmp_path, "The estimator suggests zero=stage3")
    assert text.startswith("rank 1 of 2 was killed by SIGKILL") and "out-of-memory killer" in text


def test_the_root_cause_is_kept_when_it_is_not_a_launcher_signal(tmp_path: Path) -> None:
    report = _report(_failure(0, 1, 1, "Traceback (most recent call last):"),
                     [_failure(1, 0, -15, "Signal 15 (SIGTERM) received by PID 1"),
                      _failure(2, 2, 1, "Traceback (most recent call last):")])
    failed = _read(tmp_path, report).first_failure()
    assert failed is not None and (failed.rank, failed.exitcode, failed.traceback) == (1, 1, True)


def test_a_single_failure_and_no_report(tmp_path: Path) -> None:
    failed = _read(tmp_path, _report(_failure(0, 0, -11, "Signal 11 (SIGSEGV) received by PID 1"), [])).first_failure()
    assert failed is not None and (failed.rank, failed.signal_name) == (0, "SIGSEGV")
    assert _read(tmp_path, "plain output\n").first_failure() is None
