"""Timing of each optimizer step, split into phases: :class:`StepRecorder` and the callback feeding it."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness.config import PHASES, BenchConfig
from benchmarks.harness.probes import attach_probes, count_by_hand, live_tensor_bytes
from lightning_zero import ZeroStrategy


class StepRecorder:
    """Wall time (``perf_counter``) and process CPU time of each optimizer step, split into :data:`PHASES`."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []  # CPU time of the whole process (gloo's threads included)
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.extra: dict[str, list[float]] = {}  # --profile probes
        self.state: dict[str, float] = {}  # model-state bytes, sampled before the last optimizer step
        self.losses: list[float] = []  # this rank's training loss of every step
        self.info: dict[str, float] = {}  # one-off facts of the run (e.g. DeepSpeed's first initialize)
        self._t0 = self._last = self._c0 = self._excluded = 0.0
        self._now: dict[str, float] = {}
        # tensors alive before the run: a pool worker runs many systems, and a library may keep references to an
        # earlier run's objects (DeepSpeed's did: the same 20M model read 676 MB in one cell, 1527 MB in another)
        self.live_base = live_tensor_bytes()

    def live_state_bytes(self) -> float:
        """The tensor bytes this run added (its model state, for systems not counted by hand)."""
        return max(0.0, live_tensor_bytes() - self.live_base)

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self._c0, self._excluded, self._now = time.process_time(), 0.0, {}

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to ``phase``."""
        now = time.perf_counter()
        self._now[phase] = self._now.get(phase, 0.0) + now - self._last
        self._last = now

    def exclude_since_mark(self) -> None:
        """Leave the time since the previous mark (a measurement of ours) out of the step."""
        now = time.perf_counter()
        self._excluded += now - self._last
        self._last = now

    def add(self, key: str, seconds: float) -> None:
        self.extra.setdefault(key, [0.0] * len(self.times))
        self._now["probe:" + key] = self._now.get("probe:" + key, 0.0) + seconds

    def end(self, loss: Any = None) -> None:
        self.mark("after_step")
        if loss is not None:
            self.losses.append(float(loss))
        self.times.append(self._last - self._t0 - self._excluded)
        self.cpu.append(time.process_time() - self._c0)
        for p in PHASES:
            self.phases[p].append(self._now.get(p, 0.0))
        for key, values in self.extra.items():
            values.append(self._now.get("probe:" + key, 0.0))


class TimingCallback(Callback):
    """Feeds a :class:`StepRecorder` (one record per optimizer step; no gradient accumulation). The phases
    end at on_before_backward (forward; Lightning's zero_grad included), on_after_backward (backward),
    on_before_optimizer_step (reduce: the strategy's work between backward and the optimizer), the
    optimizer's step post-hook (optimizer) and on_train_batch_end (after_step)."""

    def __init__(self, rec: StepRecorder, config: BenchConfig) -> None:
        self.rec, self.config = rec, config

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.rec.mark("optimizer"))
        if self.config.profile and isinstance(trainer.strategy, ZeroStrategy):
            attach_probes(trainer.strategy, self.rec)

    def on_train_batch_start(self, *_: Any) -> None:
        self.rec.start()

    def on_before_backward(self, *_: Any) -> None:
        self.rec.mark("forward")

    def on_after_backward(self, *_: Any) -> None:
        self.rec.mark("backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *_: Any) -> None:
        self.rec.mark("reduce")
        if len(self.rec.times) == self.config.total_steps - 1:
            strategy = trainer.strategy
            self.rec.state = (asdict(strategy.model_state_bytes()) if isinstance(strategy, ZeroStrategy) else
                              count_by_hand(trainer.lightning_module, trainer.optimizers[0],
                                             isinstance(strategy.model, DistributedDataParallel)))  # fmt: skip
            self.rec.state["live"] = self.rec.live_state_bytes()
            self.rec.exclude_since_mark()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.rec.end(outputs["loss"] if isinstance(outputs, dict) else outputs)
