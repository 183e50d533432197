"""``lightning-zero train`` as a newcomer meets it, on real 2-rank runs of ``experiment=gpt_tiny`` (console
captured through a pipe, as CI or ``| tee`` would): progress lines, no noise on the console but all of
it in ``train.log``, the TensorBoard dashboard of an fp32 and an fp16 run (one run per training run, the
loss and the vital signs first, memory in MiB, a layout of existing tags, hparams that tell the runs apart
against a few metrics, monotone steps), run directories named by their choices, a resume whose start
value is the checkpoint's, the summary of a rank killed by SIGKILL, and ranks that end right after their exit
handlers (Note [rank exit] in lightning_zero/config/run/worker.py). The fp32 run is the session's real launch of
the docs' ``lightning-zero train experiment=gpt_tiny``; the fp16 run and the resume run their ranks in the pool
(Note [shared launches] in tests/launches.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from docs.regenerate import check_test_quote
from lightning_zero.config.run.console import NOISE
from tests.launches import GPT_TINY, Launch, SharedLaunches

REAL_GPT_TINY = ("lightning-zero", *GPT_TINY)  # the real launch the `runs` fixture reads (tests/launches.py)
ONE_DEVICE = ("train", "experiment=gpt_tiny", "trainer=cpu1")
STEPS = 20  # gpt_tiny's own: the docs' `lightning-zero train experiment=gpt_tiny` (tests/launches.py GPT_TINY)
PROGRESS = re.compile(r"^step (\d+)/(\d+)  loss \d\.\d+  tokens/s [\d,]+  elapsed \d+:\d\d:\d\d  ETA \d+:\d\d:\d\d$")


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "lightning_zero", "train", *args]


@pytest.fixture(scope="module")
def runs(launches: SharedLaunches) -> dict[str, tuple[Path, Launch]]:
    """The fp32 run: the session's real 2-rank launch of GPT_TINY (its console through a pipe, its processes'
    exits probed); the fp16 run: the same command with precision=fp16, its ranks in the pool (what it shows is
    the run directory and the dashboard, which the ranks write the same way there)."""
    fp32 = launches.cli(*GPT_TINY).check()
    fp16 = launches.pool_cli(*GPT_TINY, "precision=fp16").check()
    return {"fp32": (fp32.run_dir, fp32), "fp16": (fp16.run_dir, fp16)}


def _console(done: Launch) -> list[str]:
    return done.output.splitlines()


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_the_console_shows_progress_lines_and_no_noise(runs) -> None:
    run, done = runs["fp32"]
    lines = _console(done)
    progress = [m for m in map(PROGRESS.match, lines) if m]
    assert [(int(m[1]), int(m[2])) for m in progress] == [(s, STEPS) for s in (5, 10, 15, 20)], "\n".join(lines)
    assert "training on 2 rank(s): 20 steps" in lines
    vals = [line for line in lines if re.fullmatch(r"step \d+  val_loss \d\.\d{4}", line)]
    assert [v.split()[1] for v in vals] == ["0", "5", "10", "15", "20"], vals  # start, every 5 (the end: not twice)
    noisy = [line for line in lines if any(p.search(line) for p in NOISE)]
    assert not noisy, noisy
    log = (run / "train.log").read_text()
    assert "Tip: For seamless cloud logging" in log  # the console left it out; the log keeps everything
    assert "Total params" in log and "flops" not in log.lower()  # the model summary, without unmeasured FLOPs
    assert all(line in log for line in lines if line.startswith("step "))
    assert "drop" in done.stdout.splitlines()[-1]  # the summary ends the run (Hydra logs to stdout)


@pytest.mark.slow
@pytest.mark.real_launch(("lightning-zero", *ONE_DEVICE))
def test_the_smoke_run_learns_on_one_replica_and_prints_each_line_once(launches: SharedLaunches) -> None:
    """``experiment=gpt_tiny`` on one data replica (what cpu1, tp2, sp2 and pp2 train: their losses equal this run's,
    tests/e2e/test_sequence_parallel.py, test_pipeline_tensor_parallel.py) ended ``val_loss 5.4716 -> 5.5431``: its
    validation split was a build's configuration dump. And the run in one process printed each Lightning line twice
    (``INFO: ...`` and Hydra's format), the model summary twice, and the noise the 2-rank console drops."""
    done = launches.cli(*ONE_DEVICE)  # a process: its console as a user sees it
    lines = _console(done)
    assert done.returncode == 0, "\n".join(lines[-40:])
    summary = re.search(r"steps=20 fit_time=[\d.]+s val_loss (\d\.\d{4}) -> (\d\.\d{4}) \(drop ([\d.]+) nats\)",
                        done.stdout.splitlines()[-1])  # Hydra logs to stdout
    assert summary and float(summary[3]) > 1.0, done.stdout  # 5.3317 -> 2.8865 when written
    vals = [float(line.split()[-1]) for line in lines if re.fullmatch(r"step \d+  val_loss \d\.\d{4}", line)]
    assert len(vals) == 5 and vals == sorted(vals, reverse=True), vals  # every validation point lower
    for once in ("GPU available: False, used: False", "`Trainer.fit` stopped: `max_steps=20` reached."):
        assert lines.count(once) == 1, "\n".join(lines)
    assert sum("Trainable params" in line for line in lines) == 1  # the model summary, once
    assert not [line for line in lines if line.startswith("INFO: ") or "rank_zero][INFO]" in line]
    noisy = [line for line in lines if any(p.search(line) for p in NOISE) or "already configured" in line]
    assert not noisy, noisy
    log = (done.run_dir / "train.log").read_text()
    assert "GPU available" in log and "Tip: For seamless cloud logging" in log  # train.log keeps everything


def _layout(acc: EventAccumulator) -> dict[str, list[str]]:
    event = acc.Tensors("custom_scalars__config__")[-1]  # TensorBoard shows the last layout written
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    return {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}


def _hparams(acc: EventAccumulator) -> dict[str, object]:
    meta = acc.SummaryMetadata("_hparams_/session_start_info")
    info = plugin_data_pb2.HParamsPluginData.FromString(meta.plugin_data.content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def _steps_in_write_order(run_dir: Path) -> dict[str, list[int]]:
    """Every scalar's steps in the order they were written (files by creation, as TensorBoard reads them)."""

    def created(path: Path) -> tuple[int, int, int]:
        # events.out.tfevents.<seconds>.<host>.<pid>.<writer number>: files made in the same second come
        # in the order their writers were made (a host name may hold dots, so count from both ends)
        parts = path.name.split(".")
        return int(parts[3]), int(parts[-2]), int(parts[-1])

    order: dict[str, list[int]] = defaultdict(list)
    for path in sorted(run_dir.glob("events.out.tfevents.*"), key=created):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars" or value.HasField("simple_value"):
                    order[value.tag].append(event.step)
    return order


def _experiment(acc: EventAccumulator) -> plugin_data_pb2.Experiment:
    meta = acc.SummaryMetadata("_hparams_/experiment")  # the HParams tab's columns
    return plugin_data_pb2.HParamsPluginData.FromString(meta.plugin_data.content).experiment


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_ranks_and_cli_run_their_exit_handlers_then_skip_the_interpreter_s_teardown(runs) -> None:
    probe = runs["fp32"][1].exit_probe
    assert probe is not None
    assert sorted(p.name for p in probe.glob("exit-*")) == ["exit-0", "exit-1", "exit-cli"]  # every handler ran
    assert not list(probe.glob("finalized-*"))  # no module teardown: ~2 s per rank, ~1 s the CLI (Note [rank exit])


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_the_run_directory_is_named_by_the_run_s_choices(runs) -> None:
    run, _ = runs["fp16"]  # outputs/<date>/<time>_<name>: the name TensorBoard lists the run by
    assert re.fullmatch(r"\d\d-\d\d-\d\d_gpt_tiny-zero2-fp16", run.name), run


def test_run_names_and_hparams_tell_the_choices_apart() -> None:
    from lightning_zero.config.paths import run_name
    from lightning_zero.config.run.build import run_hparams
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.validate import validate_config

    assert run_name("gpt_small", 3, "bf16", "optimizer_cpu", "pp2_1f1b", "onebit_adam") == \
        "gpt_small-zero3-bf16-optimizer_cpu-pp2_1f1b-onebit_adam"
    assert run_name("gpt_tiny", 2, "fp32", "none", "none", "adamw") == "gpt_tiny-zero2-fp32"  # defaults left out
    assert run_name("gpt_tiny", 2, "fp32", "none", "none", "adamw", "docs/examples/ds_config.json") == \
        "gpt_tiny-ds_config"  # the JSON sets the stage and precision after Hydra named the directory
    onebit = validate_config(compose_config(["experiment=gpt_tiny", "zero=stage0", "model.optimizer=onebit_adam",
                                             "model.freeze_step=5"]))
    assert run_hparams(onebit)["optimizer"] == "onebit_adam"  # not mistaken for an AdamW run in HParams


def _main_run(run: Path) -> tuple[EventAccumulator, set[str]]:
    main = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    main.Reload()
    return main, set(main.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_the_dashboard_has_one_run_per_training_run(runs) -> None:
    for name, (run, _) in runs.items():
        # no per-rank sub-runs: TensorBoard's run list has one entry (one colour) per training run
        assert {p.parent for p in run.rglob("events.out.tfevents.*")} == {run / "tb"}, name
        main, tags = _main_run(run)
        for r in (0, 1):  # each rank's values are tags of that run
            assert {f"time/step_rank{r}", f"time/comm_rank{r}", f"memory_MiB/params_rank{r}",
                    f"memory_MiB/peak_rank{r}"} <= tags, (name, sorted(tags))
        # a per-rank chart of the custom scalars has a line for each rank, all in the one run
        layout = _layout(main)
        assert {t for t in tags if re.search(layout["peak memory (MiB)"][0], t)} == {"memory_MiB/peak_rank0",
                                                                                     "memory_MiB/peak_rank1"}
        for title, patterns in layout.items():  # the layout refers only to tags the run has
            assert any(re.search(p, t) for p in patterns for t in tags), (name, title)
        assert ("fp16 loss scale" in layout) == (name == "fp16")
        assert list(layout)[:2] == ["training loss (mean over ranks and micro-batches)", "validation loss"]


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_the_dashboard_opens_on_the_loss_and_the_vital_signs(runs) -> None:
    for name, (run, _) in runs.items():
        main, tags = _main_run(run)
        # one training loss, both losses in the first group TensorBoard opens, no `epoch` group before it
        assert {"loss/train", "loss/val"} <= tags and not {"train_loss", "train/loss", "val_loss", "epoch"} & tags
        # Time Series opens the first two groups (by name): the losses, then lr, gradient norm, loss scale, tokens/s
        groups = sorted({t.split("/")[0] for t in tags})
        assert groups[:2] == ["loss", "main"], groups
        assert {"main/lr", "main/grad_norm", "main/tokens_per_s"} <= tags
        assert ("main/loss_scale" in tags) == (name == "fp16")
        assert [e.step for e in main.Scalars("loss/train")] == [5, 10, 15, 20]
        assert len({e.step for e in main.Scalars("loss/val")}) == 5  # 0, 5, 10, 15, 20: a curve
        for path, steps in _steps_in_write_order(run / "tb").items():
            assert steps == sorted(steps), (name, path, steps)  # no out-of-order step


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_the_dashboard_shows_memory_in_mib_and_no_series_that_is_always_zero(runs) -> None:
    for name, (run, _) in runs.items():
        main, tags = _main_run(run)
        memory = [t for t in tags if t.startswith("memory_MiB/")]  # the unit in the group name
        assert len(memory) >= 6, memory  # params, grads, optimizer, peak of each rank
        for tag in memory:
            values = [e.value for e in main.Scalars(tag)]
            assert any(values) and max(values) < 1e5, (name, tag, values)  # MiB, not bytes; never a flat zero
        assert all(e.value > 50 for r in (0, 1) for e in main.Scalars(f"memory_MiB/peak_rank{r}"))  # the process


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_the_hparams_table_compares_runs_by_choices_and_a_few_metrics(runs) -> None:
    hparams = {}
    for name, (run, _) in runs.items():
        main, _tags = _main_run(run)
        hparams[name] = _hparams(main)
        # a short list of comparable metric columns, the ZeRO choices listed first
        experiment = _experiment(main)
        assert [m.name.tag for m in experiment.metric_infos] == ["loss/train", "loss/val", "main/tokens_per_s",
                                                                 "memory_MiB/peak_rank0", "memory_MiB/peak_rank1"]
        assert {h.name for h in experiment.hparam_infos if h.differs} == {"zero_stage", "offload", "precision",
                                                                          "optimizer", "pipeline"}
        config = main.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert "reduce_bucket_size" in config and "max_val_samples" in config  # the rest of the config: Text tab
    assert set(hparams["fp32"]) == {"zero_stage", "offload", "precision", "pipeline", "tensor_parallel",
                                    "sequence_parallel", "expert_parallel", "attention", "model", "params_M",
                                    "world_size", "global_batch", "optimizer", "lr"}
    assert {k for k in hparams["fp32"] if hparams["fp32"][k] != hparams["fp16"][k]} == {"precision"}
    assert hparams["fp32"]["world_size"] == 2 and hparams["fp32"]["global_batch"] == 16  # 2 ranks x 8
    assert hparams["fp32"]["optimizer"] == "adamw"


@pytest.mark.slow
@pytest.mark.real_launch(REAL_GPT_TINY)
def test_resume_reports_the_checkpoint_s_validation_loss_as_start(runs, launches: SharedLaunches,
                                                                 tmp_path: Path) -> None:
    shared, _ = runs["fp32"]
    run = tmp_path / "run"
    shutil.copytree(shared, run, symlinks=True)  # the shared run stays as it was for the other tests
    first = json.loads((run / "result.json").read_text())
    done = launches.pool_cli(*GPT_TINY, f"trainer.resume_from={run / 'checkpoints' / 'last.ckpt'}",
                             f"trainer.max_steps={STEPS + 5}", f"hydra.run.dir={run}")  # its TensorBoard events go on
    done.check()
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["global_step"] == STEPS + 5
    assert resumed["val_loss_start"] == pytest.approx(first["val_loss_end"], rel=1e-5)  # not the untrained model's
    assert f"resuming at step {STEPS}" in done.output
    for path, steps in _steps_in_write_order(run / "tb").items():
        assert steps == sorted(steps), (path, steps)


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` among ``parent``'s descendants (from /proc)."""
    children: dict[int, list[int]] = defaultdict(list)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(proc.name))
    todo = list(children[parent])
    while todo:
        pid = todo.pop()
        todo += children[pid]
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"lightning_zero.config.run.worker" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def _run_rank_killed_by_sigkill(root: Path) -> dict[str, Any]:
    """``lightning-zero train`` with rank 1 SIGKILLed at its first progress line: the exit code and the console."""
    proc = subprocess.Popen(_command(["experiment=gpt_tiny", "trainer.max_steps=100000", "trainer.max_time=null",
                                      f"hydra.run.dir={root / 'run'}"]),
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    killed = False
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not killed and PROGRESS.match(lines[-1]):
                pid = _rank_pid(proc.pid, 1)
                assert pid is not None
                os.kill(pid, signal.SIGKILL)  # as the out-of-memory killer would
                killed = True
            assert time.monotonic() < deadline, "\n".join(lines[-50:])
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    return {"code": code, "killed": killed, "lines": lines, "root": root}


@pytest.mark.slow
@pytest.mark.lane(run=_run_rank_killed_by_sigkill)  # Note [background lane] in tests/lane.py
def test_a_rank_killed_by_sigkill_ends_with_a_short_summary(lane_result: dict[str, Any]) -> None:
    lines, root = lane_result["lines"], lane_result["root"]
    assert lane_result["code"] == 1 and lane_result["killed"], "\n".join(lines[-40:])
    end = "\n".join(lines[-6:])
    assert "rank 1 of 2 was killed by SIGKILL (it printed no traceback" in end, "\n".join(lines[-40:])
    assert "Likely cause: the out-of-memory killer" in end and "The estimator suggests" in end
    assert "The estimator's host memory for this configuration (stage 2" in end and "per rank" in end, end
    assert "Settings that lower it: data.micro_batch_size=" in end, end
    assert "zero=stage" in end and str(root / "run" / "train.log") in end
    assert "Traceback" not in "\n".join(lines[-8:])  # no launcher traceback after the summary
    assert "Root Cause" in (root / "run" / "train.log").read_text()  # torchrun's full report stays there
    for doc in ("docs/configs.md", "docs/reliability.md"):  # the summary they quote (Note [quoted output])
        test = "tests/e2e/test_cli_runs.py::test_a_rank_killed_by_sigkill_ends_with_a_short_summary"
        issues = check_test_quote(doc, test, "\n".join(lines), root)
        assert not issues, f"{doc} quotes this summary: refresh it with .venv/bin/python docs/regenerate.py " \
                           f"--only {doc}\n" + "\n".join(issues)


_HANG_TIMEOUT_S = 4.0


def _run_stopped_rank(root: Path) -> dict[str, Any]:
    """``lightning-zero train`` at hang_timeout_s=4 with rank 1 SIGSTOPped at its first progress line: the exit
    code, how long after the stop the command ended, the stopped rank's pid and the console."""
    proc = subprocess.Popen(_command(["experiment=gpt_tiny", "trainer.max_steps=100000", "trainer.max_time=null",
                                      f"zero.hang_timeout_s={_HANG_TIMEOUT_S}", f"hydra.run.dir={root / 'run'}"]),
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    stopped_at, pid = None, None
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if stopped_at is None and PROGRESS.match(lines[-1]):
                pid = _rank_pid(proc.pid, 1)
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
            assert time.monotonic() < deadline, "\n".join(lines[-50:])
        code = proc.wait(timeout=60)
        ended = time.monotonic() - stopped_at if stopped_at is not None else None
    finally:
        proc.kill()
        if pid is not None and Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)  # a rank this run stopped (it is its descendant): never left behind
    return {"code": code, "ended": ended, "pid": pid, "lines": lines}


@pytest.mark.slow
@pytest.mark.lane(run=_run_stopped_rank)  # Note [background lane] in tests/lane.py
def test_a_stopped_rank_is_ended_and_the_job_ends_right_after_the_finding(lane_result: dict[str, Any]) -> None:
    """A rank stopped with SIGSTOP is named by the hang watchdog, but the job ended 30 s later: torchrun sends
    SIGTERM, which a stopped process does not act on, and SIGKILL only after 30 s (76 s from the stop on a loaded
    machine at the default 45 s; issue 41, 11). Now the reporting rank ends it (Note [ending a silent rank]) and the
    command exits right after the finding, with the hang watchdog's summary, not an out-of-memory one."""
    code, ended, pid, lines = lane_result["code"], lane_result["ended"], lane_result["pid"], lane_result["lines"]
    hang_timeout = _HANG_TIMEOUT_S
    text = "\n".join(lines)
    assert code == 1 and ended is not None, text[-3000:]
    print(f"the command exited {ended:.1f} s after the stop (hang_timeout_s={hang_timeout:g})")
    # the finding after hang_timeout_s + one interval, the others' acknowledgements (2 intervals + 0.5 s), the ranks'
    # and torchrun's exits, and the launcher's summary, on a loaded machine; torchrun's SIGKILL would come >= 30 s
    # after the live ranks' exit
    assert ended < hang_timeout + 16, (ended, text[-3000:])
    assert re.search(r"no heartbeat from rank 1 \(pid \d+, silent", text), text[-3000:]
    assert f"ended the silent rank 1 (pid {pid}) with SIGKILL" in text, text[-3000:]
    end = "\n".join(lines[-6:])
    assert "was stopped by the hang watchdog (exit code 75" in end and "out-of-memory" not in end, end
