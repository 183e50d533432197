"""The ZeroStatsMonitor dashboard: a 2-rank fp16 fit whose TensorBoard event file is read back (every scalar,
with values checked against what the ranks saw), the custom-scalars layout, per-rank profiler traces; the
monitor's wiring into the strategy and the Hydra path (one process)."""

from __future__ import annotations

import csv
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_zero import LossScalerConfig, ProfilerWindow, ZeroPrecision, ZeroStatsMonitor, ZeroStrategy
from lightning_zero.observability.monitoring import MEMORY_KEYS, TIME_KEYS, batch_counts, peak_memory_bytes
from tests.distributed.test_precision import Model, pattern_loader
from tests.models import make_trainer

# the seed's fp16 config: {"loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
SEED_FP16 = LossScalerConfig(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                             min_loss_scale=1)
STEPS, ACCUMULATE, POISONED_STEP = 6, 2, 2  # rank 1's gradient gets an inf in micro-batch 4: step 2 (0-based)
GLOBAL_TAGS = ("train/loss", "train/lr", "train/lr_pg1", "train/grad_norm", "train/loss_scale",
               "train/skipped_steps", "throughput/samples_per_s", "throughput/tokens_per_s")


def _events(log_dir: Path, files: int = 1) -> EventAccumulator:
    """The run's events (a directory: all its event files, as TensorBoard reads them)."""
    found = list(log_dir.glob("events.out.tfevents.*"))
    assert len(found) == files, found  # in a fit, rank 0 alone writes one file for every rank's scalars
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _series(acc: EventAccumulator, tag: str) -> dict[int, float]:
    """``{0-based optimizer step: value}``: the monitor writes at ``global_step`` after the step (1, 2, ...)."""
    return {e.step - 1: e.value for e in acc.Scalars(tag)}


class _Probe(pl.Callback):
    """What the rank knows: the strategy's gradient norm after each step; at the end, its model-state bytes
    and peak RSS."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        # independent clocks: the hooks' windows per optimizer step, the whole fit's span
        self.clock: list[dict[str, float]] = []
        self._t: dict[str, float] = {}
        self._open = {"forward": 0.0, "backward": 0.0}

    def on_train_start(self, *args: Any) -> None:
        self._t["train_start"] = time.perf_counter()

    def on_train_batch_start(self, *args: Any) -> None:
        self._t["start"] = time.perf_counter()

    def on_before_backward(self, *args: Any) -> None:
        self._t["backward"] = now = time.perf_counter()
        self._open["forward"] += now - self._t["start"]

    def on_after_backward(self, *args: Any) -> None:
        self._open["backward"] += time.perf_counter() - self._t["backward"]

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._t["optimizer"] = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if len(self.norms) < trainer.global_step:
            self.norms.append(trainer.strategy.last_grad_norm)
            now = time.perf_counter()
            self.clock.append({**self._open, "optimizer": now - self._t["optimizer"],
                               "span": now - self._t["train_start"]})
            self._open = {"forward": 0.0, "backward": 0.0}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.bytes = dataclasses.asdict(trainer.strategy.model_state_bytes())
        self.peak = peak_memory_bytes(torch.device("cpu"))


class _TimedModel(Model):
    """The model with its own clocks: each training_step (the forward) and each optimizer.step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.forward_seconds: list[float] = []
        self.step_seconds: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        loss = super().training_step(batch, batch_idx)
        self.forward_seconds.append(time.perf_counter() - start)
        return loss


def dashboard_body(log_dir: str) -> dict[str, Any]:
    """fp16, stage 2, 6 steps of 2 micro-batches, clipping; one injected overflow; profiler over steps 2-3."""
    probe, model = _Probe(), _TimedModel(poison_at=(2 * POISONED_STEP,))
    timings = model.step_seconds
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    handles = [register_optimizer_step_pre_hook(lambda *a: timings.append(-time.perf_counter())),
               register_optimizer_step_post_hook(lambda *a: timings.append(time.perf_counter()))]
    strategy = ZeroStrategy(stage=2, precision=ZeroPrecision("16-mixed", loss_scaler=SEED_FP16),
                            profiler=ProfilerWindow(wait=1, warmup=1, active=2))
    trainer = make_trainer(strategy, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, log_every_n_steps=1,
                           gradient_clip_val=1.0, logger=TensorBoardLogger(log_dir, name="", version=""),
                           enable_progress_bar=True, callbacks=[probe])
    try:
        trainer.fit(model, pattern_loader())
    finally:
        for h in handles:
            h.remove()
    return {"losses": model.losses, "norms": probe.norms, "clock": probe.clock, "forward_s": model.forward_seconds,
            "optimizer_s": [a + b for a, b in zip(timings[::2], timings[1::2])], "bytes": probe.bytes,
            "peak": probe.peak,
            "skipped": strategy.skipped_steps,
            "monitors": sum(isinstance(c, ZeroStatsMonitor) for c in trainer.callbacks),
            "pbar": dict(trainer.progress_bar_metrics)}


@pytest.fixture(scope="module")
def dashboard(gloo_pool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    log_dir = tmp_path_factory.mktemp("tb")
    return log_dir, gloo_pool.run("tests.distributed.test_monitor:dashboard_body", log_dir=str(log_dir))


@pytest.mark.distributed
def test_the_event_file_holds_every_scalar_with_plausible_values(dashboard) -> None:
    log_dir, ranks = dashboard
    acc = _events(log_dir)
    tags = set(acc.Tags()["scalars"])
    # a memory series is written from the first step it is not zero (comm buffers are empty at a step's end here)
    assert not any(r["bytes"]["comm_buffers"] for r in ranks) and not any("buffers" in t for t in tags)
    memory_keys = [k for k in MEMORY_KEYS if k != "buffers"]
    per_rank = {f"{topic}/rank{r}/{k}" for r in (0, 1) for topic, keys in (("time", TIME_KEYS), ("memory", memory_keys))
                for k in keys}
    assert set(GLOBAL_TAGS) | per_rank <= tags, sorted(set(GLOBAL_TAGS) | per_rank - tags)
    steps = list(range(STEPS))
    for tag in (*GLOBAL_TAGS, *per_rank):
        expected = [s for s in steps if not (tag == "train/grad_norm" and s == POISONED_STEP)]
        assert sorted(_series(acc, tag)) == expected, tag  # every optimizer step, Lightning's step axis

    # loss: the mean over both ranks' micro-batches of the step (accumulation undone)
    loss = _series(acc, "train/loss")
    for s in steps:
        micro = [r["losses"][ACCUMULATE * s + i] for r in ranks for i in range(ACCUMULATE)]
        assert loss[s] == pytest.approx(sum(micro) / len(micro), rel=1e-5)
    # fp16: the seed config starts at 2**16; one overflow spends a hysteresis credit and keeps the scale
    assert set(_series(acc, "train/loss_scale").values()) == {65536.0}
    assert list(_series(acc, "train/skipped_steps").values()) == [float(s >= POISONED_STEP) for s in steps]
    assert all(r["skipped"] == 1 for r in ranks)
    assert all(0 < v < 100 for v in _series(acc, "train/grad_norm").values())
    for r in ranks:  # the strategy's own value: inf on the skipped step, also when clipping (nothing to clip)
        assert [math.isinf(n) for n in r["norms"]] == [s == POISONED_STEP for s in steps]
        assert [n for s, n in enumerate(r["norms"]) if s != POISONED_STEP] == pytest.approx(
            [v for s, v in sorted(_series(acc, "train/grad_norm").items())], rel=1e-5)
    # the LR the step used; the per-step schedule (0.98**k) does not advance on the skipped step
    stepped = [s - (s > POISONED_STEP) for s in steps]
    assert list(_series(acc, "train/lr").values()) == pytest.approx([1e-2 * 0.98**k for k in stepped], rel=1e-6)
    assert _series(acc, "train/lr_pg1") == _series(acc, "train/lr")

    # throughput: 2 ranks x 2 micro-batches x 4 samples of 9 token ids per step, over the slowest rank's step
    samples, tokens = _series(acc, "throughput/samples_per_s"), _series(acc, "throughput/tokens_per_s")
    for s in steps:
        slowest = max(_series(acc, f"time/rank{r}/step")[s] for r in (0, 1))
        assert samples[s] * slowest == pytest.approx(16, rel=1e-4)
        assert tokens[s] == pytest.approx(9 * samples[s], rel=1e-5)

    for r, result in enumerate(ranks):
        t = {k: _series(acc, f"time/rank{r}/{k}") for k in TIME_KEYS}
        for s in steps:
            assert t["step"][s] > 0 and t["forward"][s] > 0 and t["backward"][s] > 0 and t["optimizer"][s] > 0
            assert t["comm"][s] >= 0 and t["other"][s] >= 0
            # each measured phase against independent clocks. forward: its window holds the training_step,
            # timed inside the module; optimizer: its window holds optimizer.step (no communication inside
            # at stage 2), timed by torch's step hooks; every phase is its hooks' window less the
            # communication inside, so never more than the window the probe's own hooks see
            clock, slack = result["clock"][s], 0.005
            forward = sum(result["forward_s"][ACCUMULATE * s:ACCUMULATE * (s + 1)])
            assert forward - slack <= t["forward"][s] <= clock["forward"] + slack, (r, s, t["forward"][s], forward)
            assert t["backward"][s] <= clock["backward"] + slack, (r, s)
            if s != POISONED_STEP:  # the skipped step never calls optimizer.step
                stepped = sum(1 for k in range(s) if k != POISONED_STEP)
                step_time = result["optimizer_s"][stepped]
                assert step_time - slack <= t["optimizer"][s] <= clock["optimizer"] + slack, (r, s, step_time)
            parts = sum(t[k][s] for k in ("forward", "backward", "optimizer", "comm", "other"))
            assert parts == pytest.approx(t["step"][s], rel=1e-4, abs=1e-5)  # `other` is the remainder
        # the steps tile the fit: their sum is the probe's span from train start to the last step's end
        assert sum(t["step"].values()) == pytest.approx(result["clock"][-1]["span"], rel=0.05, abs=0.25)
        assert sum(t["comm"].values()) > 0  # gloo collectives block the host: exposed communication is measured
        m = {k: _series(acc, f"memory/rank{r}/{k}") for k in memory_keys}
        for k, field in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer")):
            assert m[k][STEPS - 1] == result["bytes"][field], (r, k)  # = strategy.model_state_bytes() on that rank
        assert result["bytes"]["optimizer"] > result["bytes"]["params"] > 0
        assert 50e6 < m["peak"][STEPS - 1] <= result["peak"]  # VmHWM: the process (torch + Lightning) at least


@pytest.mark.distributed
def test_progress_bar_profiler_traces_and_one_monitor(dashboard) -> None:
    log_dir, ranks = dashboard
    assert [r["monitors"] for r in ranks] == [1, 1]  # added by the strategy, once
    assert set(ranks[0]["pbar"]) >= {"loss", "loss_scale", "tokens/s"} and ranks[0]["pbar"]["loss_scale"] == 65536
    traces = sorted((log_dir / "profiler").glob("*.pt.trace.json"))
    assert sorted(p.name.split(".")[0] for p in traces) == ["rank0", "rank1"]  # one window, each rank its own
    assert all('"[memory]"' in p.read_text() for p in traces)  # profile_memory=True


# ---------------------------------------------------------------------------- one process
def test_batch_counts_rule() -> None:
    ids = torch.zeros(4, 9, dtype=torch.long)
    assert batch_counts((ids, ids)) == (4, 36)
    assert batch_counts({"mask": torch.ones(4, 9), "input_ids": ids}) == (4, 36)
    assert batch_counts([torch.randn(8, 3), torch.zeros(8, dtype=torch.long)]) == (8, 0)  # float inputs: no tokens
    assert batch_counts({"x": [torch.zeros(2, 5, dtype=torch.uint8)]}) == (2, 10)


def _fit(tmp_path: Path, strategy: ZeroStrategy, callbacks: list[pl.Callback] | None = None,
         **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(strategy, devices=1, max_steps=2, log_every_n_steps=1, callbacks=callbacks or [],
                           logger=CSVLogger(str(tmp_path), name="", version=""), **kwargs)
    trainer.fit(Model(), pattern_loader())
    return trainer


def test_monitor_is_on_by_default_off_by_option_and_logs_fp32_grad_norms(tmp_path: Path) -> None:
    trainer = _fit(tmp_path / "on", ZeroStrategy(stage=2))
    assert sum(isinstance(c, ZeroStatsMonitor) for c in trainer.callbacks) == 1
    with open(tmp_path / "on" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(rows) == 2 and all(float(r["train/grad_norm"]) > 0 for r in rows)  # fp32: measured for the log
    assert "train/loss_scale" not in rows[0] and all(float(r["memory/rank0/params"]) > 0 for r in rows)
    assert float(rows[0]["time/rank0/comm"]) == 0.0  # one rank: nothing to wait for
    trainer = _fit(tmp_path / "off", ZeroStrategy(stage=2, monitor=False))
    assert not any(isinstance(c, ZeroStatsMonitor) for c in trainer.callbacks)
    mine = ZeroStatsMonitor(log_every_n_steps=2)
    trainer = _fit(tmp_path / "own", ZeroStrategy(stage=1), callbacks=[mine])
    assert [c for c in trainer.callbacks if isinstance(c, ZeroStatsMonitor)] == [mine]


def test_profiler_needs_the_monitor(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="monitor"):
        ZeroStrategy(monitor=False, profiler=True)
    with pytest.raises(ValueError, match="pass `profiler=` to that one"):
        _fit(tmp_path, ZeroStrategy(stage=2, profiler=True), callbacks=[ZeroStatsMonitor()])


def test_hydra_run_logs_the_composed_config_as_hyperparameters(tmp_path: Path) -> None:
    from lightning_zero.config.run.build import fit
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.validate import validate_config

    cfg = validate_config(compose_config(["experiment=gpt_tiny", "trainer.devices=1", "trainer.max_steps=2",
                                          "trainer.log_every_n_steps=1", "trainer.checkpoint.enabled=false",
                                          "trainer.enable_model_summary=false", "data.max_bytes=20000",
                                          "profiler.enabled=true", "profiler.wait=0", "profiler.active=1"]))
    fit(cfg, tmp_path)
    acc = _events(tmp_path / "tb", files=2)  # step-0 validate, then fit (its last validation inside): a writer each
    from tensorboard.plugins.hparams import plugin_data_pb2

    meta = acc.SummaryMetadata("_hparams_/session_start_info")  # what TensorBoard's HPARAMS tab reads
    hparams = plugin_data_pb2.HParamsPluginData.FromString(meta.plugin_data.content).session_start_info.hparams
    assert hparams["zero_stage"].number_value == 2 and hparams["precision"].string_value == "fp32"
    assert hparams["model"].string_value == "gpt_tiny" and hparams["world_size"].number_value == 1
    assert "profiler/active" not in hparams  # the rest of the config is text, not hparams
    assert "profiler:\n      enabled: true" in str(acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0],
                                                     "utf-8")
    assert "hp_metric" not in acc.Tags()["scalars"]
    assert {"loss/train", "main/tokens_per_s"} <= set(acc.Tags()["scalars"])
    assert [p for p in (tmp_path / "tb").iterdir() if p.is_dir()] == [tmp_path / "tb" / "profiler"]  # one run
    assert 50 < _series(acc, "memory_MiB/peak_rank0")[1] < 1e5  # MiB (the CSV keeps bytes)
    assert list((tmp_path / "tb" / "profiler").glob("rank0.*.pt.trace.json"))
    assert not math.isnan(_series(acc, "loss/train")[1])


# ---------------------------------------------------------------------------- a pipelined run's dashboard
def pipelined_body(log_dir: str) -> dict[str, Any]:
    """2 pipeline stages, 3 steps logged every step into a ZeroTensorBoardLogger: what rank 0's bar shows."""
    import torch.distributed as dist

    from lightning_zero import PipelineConfig, ZeroTensorBoardLogger
    from tests.pipeline_models import PipeLM, loader

    config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", partition_method="uniform")
    trainer = make_trainer(ZeroStrategy(stage=1, pipeline=config), devices=dist.get_world_size(), max_steps=3,
                           log_every_n_steps=1, enable_progress_bar=True,
                           logger=ZeroTensorBoardLogger(log_dir, name="", version=""))
    trainer.fit(PipeLM("sgd"), loader(8))
    return {"pbar": sorted(trainer.progress_bar_metrics)}


@pytest.mark.distributed
def test_a_pipelined_run_logs_one_training_loss_and_no_unmeasured_step_split(gloo_pool, tmp_path: Path) -> None:
    ranks = gloo_pool.run("tests.distributed.test_monitor:pipelined_body", log_dir=str(tmp_path))
    assert "train_loss" not in ranks[0]["pbar"] and "loss" in ranks[0]["pbar"], ranks[0]["pbar"]  # the bar: once
    acc = _events(tmp_path)
    tags = set(acc.Tags()["scalars"])
    assert "loss/train" in tags and "train_loss" not in tags, sorted(tags)  # the dashboard: once
    for r in (0, 1):
        assert {f"time/step_rank{r}", f"time/optimizer_rank{r}"} <= tags, sorted(tags)
        assert all(v > 0 for k in ("step", "optimizer") for v in _series(acc, f"time/{k}_rank{r}").values())
        # the schedule runs forward, backward and the stage-to-stage sends inside training_step: no split
        assert not {f"time/{k}_rank{r}" for k in ("forward", "backward", "comm", "other")} & tags, sorted(tags)


def test_the_cli_model_summary_has_no_column_of_unmeasured_flops(tmp_path: Path) -> None:
    import logging

    from lightning_zero.config.run.build import build_callbacks
    from lightning_zero.config.run.launch import compose_config
    from lightning_zero.config.validate import validate_config
    from lightning_zero.observability.model_summary import ZeroModelSummary

    cfg = validate_config(compose_config(["experiment=gpt_tiny", "trainer.devices=1"]))
    summaries = [c for c in build_callbacks(cfg, tmp_path) if isinstance(c, ModelSummary)]
    assert [type(c) for c in summaries] == [ZeroModelSummary]  # the CLI's Trainer takes it instead of Lightning's

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.text = ""

        def emit(self, record: logging.LogRecord) -> None:
            self.text += record.getMessage()

    lines, logger = Lines(), logging.getLogger("lightning.pytorch.callbacks.model_summary")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    try:
        _fit(tmp_path, ZeroStrategy(stage=2), callbacks=[summaries[0]], enable_model_summary=True)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert "Total params" in lines.text and "Mode" in lines.text, lines.text  # the table is printed
    assert "FLOPs" not in lines.text and "Total Flops" not in lines.text, lines.text  # no example_input_array
