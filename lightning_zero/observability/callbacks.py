"""The Lightning callback :class:`ZeroStatsMonitor`: the training dashboard's scalars, per optimizer step.

(``ZeroModelSummary`` moved to ``model_summary.py``; importing it from here warns for one release.)

Note [per-rank scalars through rank 0]
    Lightning's loggers write on rank 0 only. Per-rank values (step-time split, model-state bytes,
    peak memory) reach them by one ``all_gather`` of a small float64 vector (15 numbers per rank) on
    the steps that are logged, and rank 0 writes ``time/rank<r>/...`` and ``memory/rank<r>/...`` for
    every rank through the Trainer's own loggers. So there is one event file per run (not one
    ``SummaryWriter`` per rank), CSV and other loggers get the same scalars with the same step axis as
    the module's own metrics, and no rank but 0 needs to know where the logs go. The ranks agree on
    when to gather because the cadence depends only on ``global_step`` (the same on all ranks).

Note [no split for pipelines]
    A pipelined step runs every micro-batch's forward, backward and the stage-to-stage sends inside
    ``training_step`` (the schedule replaces the module's), and the strategy's ``backward`` only reduces
    the gradients the schedule left. The hooks' windows would call the whole schedule "forward" and the
    reduction "backward", and the engine's ``comm`` clock does not see the sends. The monitor writes
    ``time/rank<r>/step`` and ``optimizer`` (its window is the same as without a pipeline) for a
    pipelined run and leaves ``forward``, ``backward``, ``comm`` and ``other`` out rather than log
    misleading numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.moe.stats import expert_groups, read_router_stats
from lightning_zero.observability.dashboard import ZeroTensorBoardLogger
from lightning_zero.observability.monitoring import (
    IO_KEYS,
    MEMORY_KEYS,
    TIME_KEYS,
    ProfilerWindow,
    batch_counts,
    io_totals,
    peak_memory_bytes,
    rank_tag,
)
from lightning_zero.observability.stats_source import stats_source

# the per-rank vector that is all-gathered: step sums, then TIME_KEYS, then MEMORY_KEYS
_SUMS = ("loss_sum", "micro_batches", "samples", "tokens")
_FIELDS = (*_SUMS, *(f"time/{k}" for k in TIME_KEYS), *(f"memory/{k}" for k in MEMORY_KEYS),
           *(f"io/{k}" for k in IO_KEYS))


class ZeroStatsMonitor(pl.Callback):
    """Logs a ZeRO run per optimizer step, with a TensorBoard dashboard and an optional profiler window.

    ``ZeroStrategy`` adds one at setup when fitting (unless ``ZeroStrategy(monitor=False)`` or the
    Trainer already has one). Every ``log_every_n_steps`` optimizer steps it writes, through the
    Trainer's loggers (Note [per-rank scalars through rank 0]):

    - ``train/loss``: mean of ``training_step``'s loss over the step's micro-batches on all ranks;
      ``train/lr`` (param group 0; ``train/lr_pg<i>`` for the others); ``train/grad_norm`` (global,
      unscaled; not on a skipped step); fp16: ``train/loss_scale``, ``train/skipped_steps``.
    - ``throughput/samples_per_s``, ``throughput/tokens_per_s``: all ranks' samples (tokens) of the
      step over its wall time (the slowest rank's); counted by
      :func:`~lightning_zero.observability.monitoring.batch_counts`.
    - ``time/rank<r>/step`` (wall time since the previous step ended, validation excluded), split
      into ``forward`` (``on_train_batch_start`` -> ``on_before_backward``), ``backward``
      (-> ``on_after_backward``), ``optimizer`` (``on_before_optimizer_step`` -> the end of the
      strategy's optimizer step, which includes writing the masters back and all-gathering the
      parameters), ``comm`` (time blocked in the engine's collectives, taken out of the phase it
      fell in; CPU/gloo only) and ``other`` (the rest: data loading, the end of the gradient
      reduction, unscaling and the overflow check, hooks, this monitor).
    - ``memory/rank<r>/{params,grads,optimizer,buffers}``: ``ZeroStrategy.model_state_bytes()`` (``buffers``
      is its ``comm_buffers``);
      ``memory/rank<r>/peak``: CUDA max allocated, or the process's peak RSS (VmHWM) on CPU.

    Scalars are written at the optimizer step they describe (``trainer.global_step`` after it), the axis
    of the validation loss too. A :class:`~lightning_zero.observability.dashboard.ZeroTensorBoardLogger` turns them into
    the dashboard (the loss and the vital signs first, one run per training run, memory in MiB, a
    custom-scalars layout of what the run has).
    A memory key is written from the first logged step where it is not zero on some rank (no flat zero
    lines: ``buffers`` is often empty at the end of a step). A pipelined run writes only ``step`` and
    ``optimizer`` of the split (Note [no split for pipelines]).
    The progress bar shows rank 0's ``loss``, the fp16 ``loss_scale`` and ``tokens/s`` (rank 0's
    tokens times the world size, over rank 0's step time) every step, without communication.

    Args:
        prog_bar: show loss, loss scale and tokens/s in the progress bar.
        log_every_n_steps: logging cadence in optimizer steps (default: the Trainer's). The last
            step of ``max_steps`` is always logged.
        profiler: a :class:`~lightning_zero.observability.monitoring.ProfilerWindow` (``True``: the default one)
            runs ``torch.profiler`` with memory profiling over that window of optimizer steps and
            writes each rank's trace to ``<log dir>/profiler``.
        count_batch: ``fn(batch) -> (samples, tokens)`` of one micro-batch (default:
            :func:`~lightning_zero.observability.monitoring.batch_counts`).
    """

    def __init__(
        self,
        prog_bar: bool = True,
        log_every_n_steps: int | None = None,
        profiler: ProfilerWindow | bool | None = None,
        count_batch: Callable[[Any], tuple[int, int]] = batch_counts,
    ) -> None:
        self.prog_bar = prog_bar
        self.log_every_n_steps = log_every_n_steps
        self.profiler: ProfilerWindow | None = ProfilerWindow() if profiler is True else (profiler or None)
        self.count_batch = count_batch
        self.trace_dir: Path | None = None  # where the profiler writes (set when it starts)
        self._prof: torch.profiler.profile | None = None
        self._last_step = -1
        self._active = False
        self._cuda = False
        self._comm: DataParallelComm | None = None  # the engine's, when its waits are measurable
        self._bytes_mark: tuple[int, int] | None = None  # (global step, engine bytes sent) at the last log
        self._all_to_all_mark = (0, 0)  # (global step, MoE all-to-all bytes sent) at the last log
        self._grad_norm: float | None = None
        self._lrs: list[float] = []
        self._sums: dict[str, Any] = {}
        self._phase = {k: 0.0 for k in TIME_KEYS}
        self._marks: dict[str, tuple[float, float]] = {}  # hook -> (time, comm seconds)
        self._ref = (0.0, 0.0)  # the previous step's end
        self._pipelined = False  # the split of a pipeline's step is not measured (Note [no split for pipelines])
        self._memory_seen: set[str] = set()  # memory keys that were not zero on some rank at a logged step
        self._io_mark: tuple[int, dict[str, float]] | None = None  # (global step, io_totals) at the last log

    # ------------------------------------------------------------------ clocks
    @staticmethod
    def _engine_comm(trainer: pl.Trainer) -> DataParallelComm | None:
        """The engine's collectives when their blocked time means exposed communication: CPU tensors
        (gloo, or one rank with none); with NCCL ``wait()`` does not block the host (None then)."""
        comm = _comm_of(trainer)
        return comm if comm is not None and comm.device.type == "cpu" else None

    def _now(self, trainer: pl.Trainer, sync: bool = False) -> tuple[float, float]:
        """(wall time, comm seconds); on CUDA the device is synchronized first on steps that are logged."""
        if sync and self._cuda:
            torch.cuda.synchronize()
        comm = self._comm
        return time.perf_counter(), comm.wait_seconds if comm is not None else 0.0

    def _mark(self, trainer: pl.Trainer, name: str) -> None:
        self._marks[name] = self._now(trainer, self._logs_at(trainer, trainer.global_step + 1))

    def _lap(self, trainer: pl.Trainer, since: str, phase: str, sync: bool) -> None:
        """Add the time since mark ``since``, less the communication inside it, to ``phase``."""
        start = self._marks.pop(since, None)
        if start is not None:
            now, comm = self._now(trainer, sync)
            self._phase[phase] += (now - start[0]) - (comm - start[1])

    def _logs_at(self, trainer: pl.Trainer, step: int) -> bool:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        return bool(trainer.loggers) and every > 0 and (step % every == 0 or step == trainer.max_steps)

    def _reset(self) -> None:
        self._sums = {"loss_sum": None, "micro_batches": 0, "samples": 0, "tokens": 0}
        self._phase = {k: 0.0 for k in TIME_KEYS}
        self._marks.clear()
        self._grad_norm = None

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cuda = trainer.strategy.root_device.type == "cuda"
        self._comm = self._engine_comm(trainer)
        self._pipelined = (source := stats_source(trainer)) is not None and source.pipelined
        self._active = bool(trainer.loggers) or (self.prog_bar and trainer.progress_bar_callback is not None)
        self._last_step = trainer.global_step
        engine_comm = _comm_of(trainer)
        self._bytes_mark = (trainer.global_step, engine_comm.bytes_sent) if engine_comm is not None else None
        source = stats_source(trainer)
        self._io_mark = (trainer.global_step, io_totals(source.swap_io if source is not None else None))
        self._reset()
        self._ref = self._now(trainer, sync=True)
        for logger in trainer.loggers:
            if isinstance(logger, ZeroTensorBoardLogger):
                logger.follow(trainer)
        if self.profiler is not None:
            self.trace_dir = Path(trainer.log_dir or trainer.default_root_dir) / "profiler"  # every rank asks
            self._prof = self.profiler.build(self.trace_dir, trainer.global_rank, self._cuda)
            self._prof.start()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._active:
            return
        samples, tokens = self.count_batch(batch)
        self._sums["samples"] += samples
        self._sums["tokens"] += tokens
        self._mark(trainer, "start")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._active:
            self._lap(trainer, "start", "forward", self._logs_at(trainer, trainer.global_step + 1))
            self._mark(trainer, "backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._lap(trainer, "backward", "backward", self._logs_at(trainer, trainer.global_step + 1))

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._active:
            return
        source = stats_source(trainer)
        if (source is not None and source.engine_comm is not None and source.last_grad_norm is None
                and self._logs_at(trainer, trainer.global_step + 1)):
            self._grad_norm = source.measure_grad_norm()  # fp32 without clipping: nobody measured it
        self._lrs = [float(g["lr"]) for g in optimizer.param_groups]  # the step's (schedulers step before batch end)
        self._mark(trainer, "optimizer")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stepped = trainer.global_step != self._last_step
        self._last_step = trainer.global_step
        if self._active:
            self._end_of_batch(trainer, pl_module, outputs, stepped)
        if stepped and self._prof is not None:
            self._prof.step()  # after the step's clock: writing a trace lands in the next step's `other`

    def _end_of_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, stepped: bool) -> None:
        """Add the micro-batch's loss; at the end of an optimizer step, close its clock, log and show it."""
        logs = self._logs_at(trainer, trainer.global_step)
        loss = _micro_batch_loss(outputs, trainer, pl_module)
        if loss is not None:
            total = self._sums["loss_sum"]
            self._sums["loss_sum"] = loss if total is None else total + loss
            self._sums["micro_batches"] += 1
        if not stepped:
            return
        self._lap(trainer, "optimizer", "optimizer", logs)
        now, comm = self._now(trainer, sync=logs or self._logs_at(trainer, trainer.global_step + 1))
        phase = self._phase
        phase["step"] = now - self._ref[0]
        phase["comm"] = comm - self._ref[1] if self._comm is not None else math.nan
        phases = phase["forward"] + phase["backward"] + phase["optimizer"] + (comm - self._ref[1])
        phase["other"] = max(phase["step"] - phases, 0.0)
        self._ref = (now, comm)
        show = self.prog_bar and trainer.progress_bar_callback is not None
        if logs or show:
            loss_sum = self._sums["loss_sum"]
            self._sums["loss_sum"] = float(loss_sum) if loss_sum is not None else 0.0  # one device sync
        if logs:
            self._log(trainer, self._gather(trainer, self._local_row(trainer)))
        if show:
            self._show(trainer, pl_module)
        self._reset()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._ref = self._now(trainer, sync=True)  # validation is not part of the next step's time

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_profiler()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_profiler()

    def _stop_profiler(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()

    # ------------------------------------------------------------------ values
    def _local_row(self, trainer: pl.Trainer) -> list[float]:
        """This rank's numbers in the order of ``_FIELDS`` (NaN: not known here)."""
        memory = dict.fromkeys(MEMORY_KEYS, math.nan)
        if (source := stats_source(trainer)) is not None and source.engine_comm is not None:
            state = source.model_state_bytes()
            memory.update(params=state.params, grads=state.grads, optimizer=state.optimizer, buffers=state.comm_buffers)
        memory["peak"] = peak_memory_bytes(trainer.strategy.root_device)
        io = io_totals(source.swap_io if source is not None and source.engine_comm is not None else None)
        step, mark = self._io_mark or (0, dict.fromkeys(IO_KEYS, 0.0))
        steps = max(trainer.global_step - step, 1)
        self._io_mark = (trainer.global_step, io)
        return [float(self._sums[k]) for k in _SUMS] + [self._phase[k] for k in TIME_KEYS] + \
            [float(memory[k]) for k in MEMORY_KEYS] + [(io[k] - mark[k]) / steps for k in IO_KEYS]

    def _gather(self, trainer: pl.Trainer, row: list[float]) -> list[dict[str, float]]:
        """Every rank's row, by global rank (one all-gather over the default group)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [dict(zip(_FIELDS, row))]
        device = trainer.strategy.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        return [dict(zip(_FIELDS, r.tolist())) for r in rows]

    def _log(self, trainer: pl.Trainer, rows: list[dict[str, float]]) -> None:
        router = read_router_stats(trainer.lightning_module)  # every rank starts a new window
        if not trainer.is_global_zero:
            return
        metrics: dict[str, float] = dict(router)
        micro = sum(r["micro_batches"] for r in rows)
        if micro:
            metrics["train/loss"] = sum(r["loss_sum"] for r in rows) / micro
        for i, lr in enumerate(self._lrs):
            metrics["train/lr" if i == 0 else f"train/lr_pg{i}"] = lr
        source = stats_source(trainer)
        norm = source.last_grad_norm if source is not None else None
        norm = self._grad_norm if norm is None else norm
        if norm is not None and math.isfinite(norm) and not (source is not None and source.last_step_skipped):
            metrics["train/grad_norm"] = float(norm)
        if source is not None and source.loss_scale is not None:
            metrics["train/loss_scale"] = float(source.loss_scale)
            metrics["train/skipped_steps"] = float(source.skipped_steps)
        seconds = max(r["time/step"] for r in rows)
        if seconds > 0:
            metrics["throughput/samples_per_s"] = sum(r["samples"] for r in rows) / seconds
            tokens = sum(r["tokens"] for r in rows)
            if tokens:
                metrics["throughput/tokens_per_s"] = tokens / seconds
        self._memory_seen |= {k for k in MEMORY_KEYS if any(r[f"memory/{k}"] for r in rows)}  # NaN counts too
        time_keys = ("step", "optimizer") if self._pipelined else TIME_KEYS
        io_keys = IO_KEYS if any(r["io/read"] or r["io/written"] for r in rows) else ()  # disk offload only
        for rank, r in enumerate(rows):
            for topic, keys in (("time", time_keys), ("memory", [k for k in MEMORY_KEYS if k in self._memory_seen]),
                                ("io", io_keys)):
                values = {rank_tag(topic, rank, k): r[f"{topic}/{k}"] for k in keys}
                metrics.update({tag: v for tag, v in values.items() if math.isfinite(v)})
        metrics.update(self._traffic(trainer))
        metrics.update(self._all_to_all(trainer))
        for logger in trainer.loggers:  # the step just taken: validation after it is logged at the same step
            logger.log_metrics(metrics, step=trainer.global_step)

    def _traffic(self, trainer: pl.Trainer) -> dict[str, float]:
        """``traffic/bytes_per_step``: bytes this rank sent per optimizer step since the last log (the ring
        model of ``DataParallelComm.bytes_sent``; checkpoint saves in between count too); with a
        compressing optimizer (1-bit Adam), ``traffic/compression_ratio`` of its last step."""
        comm = _comm_of(trainer)
        out: dict[str, float] = {}
        if comm is None or not comm.active:
            return out
        step, sent = trainer.global_step, comm.bytes_sent
        if self._bytes_mark is not None and step > self._bytes_mark[0]:
            out["traffic/bytes_per_step"] = (sent - self._bytes_mark[1]) / (step - self._bytes_mark[0])
        self._bytes_mark = (step, sent)
        ratio = getattr(trainer.optimizers[0], "last_compression_ratio", None) if trainer.optimizers else None
        if ratio is not None:
            out["traffic/compression_ratio"] = float(ratio)
        return out

    def _all_to_all(self, trainer: pl.Trainer) -> dict[str, float]:
        """``traffic/all_to_all_bytes_per_step``: with expert parallelism, the bytes this rank's MoE layers sent to
        the other expert-parallel ranks per optimizer step since the last log (Note [all-to-all bytes])."""
        groups = {id(g): g for g in expert_groups(trainer.lightning_module)}.values()
        if not groups:
            return {}
        step, sent = trainer.global_step, sum(g.bytes_sent for g in groups)
        mark, self._all_to_all_mark = self._all_to_all_mark, (step, sent)
        return {"traffic/all_to_all_bytes_per_step": (sent - mark[1]) / (step - mark[0])} if step > mark[0] else {}

    def _show(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bar: dict[str, float] = {}
        if self._sums["micro_batches"]:
            bar["loss"] = self._sums["loss_sum"] / self._sums["micro_batches"]
        scale = source.loss_scale if (source := stats_source(trainer)) is not None else None
        if scale is not None:
            bar["loss_scale"] = float(scale)
        if self._sums["tokens"] and self._phase["step"] > 0:
            bar["tokens/s"] = self._sums["tokens"] * trainer.world_size / self._phase["step"]
        if bar:
            pl_module.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)


def add_monitor(trainer: pl.Trainer, monitor: bool, profiler: ProfilerWindow | None) -> None:
    """``ZeroStrategy``'s setup: put a :class:`ZeroStatsMonitor` first in the Trainer's callbacks when
    ``monitor``, unless the Trainer has one (which keeps its own settings)."""
    if any(isinstance(c, ZeroStatsMonitor) for c in trainer.callbacks):
        if profiler is not None:
            raise ValueError("ZeroStrategy(profiler=...) configures the monitor the strategy adds, but the "
                             "Trainer has its own ZeroStatsMonitor: pass `profiler=` to that one instead.")
        return
    if monitor:
        trainer.callbacks.insert(0, ZeroStatsMonitor(profiler=profiler))


def _comm_of(trainer: pl.Trainer) -> DataParallelComm | None:
    """The running engine's collectives, through the strategy's stats view (Note [the monitor reads a view, not
    the engine] in stats_source.py)."""
    return source.engine_comm if (source := stats_source(trainer)) is not None else None


def _micro_batch_loss(outputs: Any, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Tensor | None:
    """The loss ``training_step`` returned for this micro-batch (Lightning hands on_train_batch_end the
    loss divided by ``accumulate_grad_batches`` in automatic optimization: undone here)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        return None
    loss = loss.detach().float().reshape(())
    return loss * trainer.accumulate_grad_batches if pl_module.automatic_optimization else loss
