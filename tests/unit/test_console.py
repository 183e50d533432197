"""The launcher's reading of torchrun's failure report (no launch needed)."""

from __future__ import annotations

from pathlib import Path

from lightning_zero.config.describe import count_model_parameters
from lightning_zero.config.model_zoo import gpt_config
from lightning_zero.config.run.console import RankConsole, RankExit, failure_summary, host_memory_note


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


def test_a_sigkilled_rank_gets_the_estimators_host_memory_figure_and_the_settings_that_lower_it() -> None:
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.validate import validate_config
    from lightning_zero.estimator import estimate_memory, format_bytes

    cfg = validate_config(compose_config(["experiment=gpt_tiny", "zero=stage2"]))
    note = host_memory_note(cfg)
    assert note is not None
    # on CPU the ranks hold everything in host memory: the estimator's device total of this configuration
    shape = dict(micro_batch=cfg.data.micro_batch_size, seq_len=cfg.data.seq_len)
    g = gpt_config(cfg.model)
    expected = estimate_memory(count_model_parameters(cfg), world_size=2, gpus_per_node=2, precision="fp32",
                               offload="none", layers=g.n_layer, hidden=g.n_embd,
                               heads=g.n_head, **shape).config(2).device_total()
    assert f"stage 2, offload none, fp32, 2 ranks per node; everything, the ranks train on CPU): " \
           f"{format_bytes(expected)} per rank" in note, note
    lower = note.split("Settings that lower it: ")[1]
    assert f"data.micro_batch_size={cfg.data.micro_batch_size // 2}" in lower and "zero=stage3 (" in lower, note
    assert "zero=stage1" not in lower  # a lower stage never lowers it
    text = failure_summary(RankExit(1, -9, False), 2, Path("/run"), note)
    assert "killed by SIGKILL" in text and "out-of-memory killer" in text and "host memory" in text


def test_a_rank_stopped_by_the_hang_watchdog_is_summarised_as_such(tmp_path: Path) -> None:
    from lightning_zero.core.reliability.hang_finding import SILENT_EXIT_CODE, STUCK_EXIT_CODE

    console = RankConsole(tmp_path / "train.log", echo=lambda text: None)
    for line in _report(_failure(0, 0, STUCK_EXIT_CODE, "To enable traceback see: ..."), []).splitlines():
        console.feed(line + "\n")
    console.close()
    failed = console.first_failure()
    assert failed is not None and (failed.rank, failed.exitcode) == (0, 76)
    text = failure_summary(failed, 2, tmp_path, None)
    assert "stopped by the hang watchdog (exit code 76: every rank alive, no progress" in text, text
    assert "hang detected" in text and "traceback" not in text
    silent = failure_summary(RankExit(1, SILENT_EXIT_CODE, False), 2, tmp_path, None)
    assert "exit code 75: a rank or the store stopped answering" in silent


def test_the_host_memory_note_and_the_advice_of_a_tensor_parallel_run_count_its_tp_size() -> None:
    """With tensor_parallel=tp2 the figure is the estimator's at TP 2 (a rank's slices plus the replicated
    parameters, activations split), and the offload settings are offered as without TP (they compose), each with
    its figure at TP 2."""
    from lightning_zero.config.run.console import oom_advice
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.validate import validate_config
    from lightning_zero.estimator import estimate_memory, format_bytes

    cfg = validate_config(compose_config(["experiment=gpt_tiny", "zero=stage2", "tensor_parallel=tp2",
                                          "trainer.devices=2", "trainer.checkpoint.enabled=false"]))
    note = host_memory_note(cfg)
    assert note is not None and "tensor parallel 2" in note and "offload=param_nvme" in note, note
    g = gpt_config(cfg.model)
    expected = estimate_memory(count_model_parameters(cfg), world_size=2, gpus_per_node=2, precision="fp32",
                               offload="none", layers=g.n_layer, hidden=g.n_embd, heads=g.n_head,
                               micro_batch=cfg.data.micro_batch_size, seq_len=cfg.data.seq_len,
                               tensor_parallel=2).config(2).device_total()
    assert f"{format_bytes(expected)} per rank" in note, note
    advice = oom_advice(cfg)
    assert advice is not None and ("TP 2" in advice or "finds no configuration" in advice), advice


def test_a_silent_rank_the_watchdog_ended_is_not_taken_for_an_out_of_memory_kill(tmp_path: Path) -> None:
    """The reporting rank ends a stopped rank with SIGKILL (Note [ending a silent rank]); torchrun may name that
    rank's SIGKILL as the first failure: the summary names the hang watchdog's exit, not the out-of-memory killer."""
    report = _report(_failure(0, 1, -9, "Signal 9 (SIGKILL) received by PID 2"),
                     [_failure(1, 0, 75, "To enable traceback see: ...")])
    failed = _read(tmp_path, report).first_failure()
    assert failed is not None and (failed.rank, failed.exitcode) == (0, 75)
    text = failure_summary(failed, 2, tmp_path, "The estimator suggests zero=stage3")
    assert "stopped by the hang watchdog (exit code 75" in text and "out-of-memory" not in text, text
