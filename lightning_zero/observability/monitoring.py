"""What :class:`~lightning_zero.observability.callbacks.ZeroStatsMonitor` measures, as plain functions its
hooks call (the scalars' names and layout, peak memory, a batch's samples and tokens, the profiler's window).

Scalar names (docs/monitoring.md has the full table):

- ``train/loss``, ``train/lr`` (``train/lr_pg<i>`` for param groups i > 0), ``train/grad_norm``,
  ``train/loss_scale`` and ``train/skipped_steps`` (fp16)
- ``throughput/samples_per_s``, ``throughput/tokens_per_s``
- ``time/rank<r>/{step,forward,backward,optimizer,comm,other}`` (seconds per optimizer step)
- ``memory/rank<r>/{params,grads,optimizer,buffers,peak}`` (bytes; a key is written from the first step
  it is not zero on some rank)
- ``io/rank<r>/{read,written,busy,wait,disk_read,disk_written}`` (per optimizer step, with disk offload)

Lightning is imported only where a function needs it: ``config/schema.py`` reads :class:`ProfilerWindow` in the
launcher, which imports no Lightning (Note [lazy package names] in ``core/lazy.py``).
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

TIME_KEYS = ("step", "forward", "backward", "optimizer", "comm", "other")
MEMORY_KEYS = ("params", "grads", "optimizer", "buffers", "peak")
# per step: swap-file bytes moved and the I/O threads' busy seconds against the seconds waited for them (Note [I/O
# overlap] in core/offload/swap_io.py), and the process's disk traffic (/proc/self/io)
IO_KEYS = ("read", "written", "busy", "wait", "disk_read", "disk_written")


def rank_tag(topic: str, rank: int, key: str) -> str:
    """The name of a per-rank scalar, e.g. ``memory/rank0/params``."""
    return f"{topic}/rank{rank}/{key}"


def _chart(pattern: str) -> list[Any]:
    return ["Multiline", [pattern]]


def _dashboard_charts() -> dict[str, dict[str, str]]:
    """Every chart the dashboard can have: ``{category: {title: tag regex}}`` (tags as
    :class:`~lightning_zero.observability.dashboard.ZeroTensorBoardLogger` writes them; a per-rank chart matches
    ``<key>_rank<r>`` of every rank: one line per rank, named by its tag)."""
    return {
        "loss": {"training loss (mean over ranks and micro-batches)": r"^loss/train$",
                 "validation loss": r"^loss/val$"},
        "main": {"learning rate": r"^main/lr(_pg\d+)?$", "gradient norm (global, unscaled)": r"^main/grad_norm$",
                 "fp16 loss scale": r"^main/loss_scale$", "fp16 skipped steps": r"^main/skipped_steps$",
                 "tokens/s": r"^main/tokens_per_s$", "samples/s": r"^main/samples_per_s$"},
        "communication": {"bytes sent per optimizer step (rank 0, ring model)": r"^traffic/bytes_per_step$",
                          "compression ratio (1-bit Adam: fp32 all-reduce bytes / bytes sent)":
                              r"^traffic/compression_ratio$"},
        "mixture of experts (rank 0's routing since the last log)": {
            "tokens per expert (kept assignments, all MoE layers)": r"^moe/tokens_per_expert/\d+$",
            "dropped tokens (assignments over capacity)": r"^moe/dropped_tokens$",
            "load imbalance (busiest expert / mean)": r"^moe/load_imbalance$",
            "router losses (load balancing, z)": r"^moe/(aux|z)_loss$",
            "expert all-to-all bytes per optimizer step (rank 0)": r"^traffic/all_to_all_bytes_per_step$"},
        "step time per rank (s)": {f"{key} time (s)": rf"^time/{key}_rank\d+$" for key in TIME_KEYS},
        "memory per rank (MiB)": {f"{key} memory (MiB)": rf"^memory_MiB/{key}_rank\d+$" for key in MEMORY_KEYS},
    }


def dashboard_layout(tags: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """The TensorBoard custom-scalars layout of the charts that have data: a chart is listed only when one
    of ``tags`` (the tags written so far) matches it, a category only when it has a chart.

    The format of ``SummaryWriter.add_custom_scalars``: ``{category: {chart title: ["Multiline", [regex]]}}``.
    """
    tags = list(tags)
    out: dict[str, dict[str, list[Any]]] = {}
    for category, charts in _dashboard_charts().items():
        shown = {title: _chart(p) for title, p in charts.items() if any(re.search(p, t) for t in tags)}
        if shown:
            out[category] = shown
    return out


def flatten_hparams(params: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested mappings as ``a/b/c`` keys; values that are not bool / int / float / str become strings."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(flatten_hparams(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


def log_hyperparams(trainer: pl.Trainer, params: Mapping[str, Any]) -> None:
    """Give every logger of ``trainer`` the hyperparameters ``params`` (nested keys become ``a/b``).

    A :class:`~lightning_zero.observability.dashboard.ZeroTensorBoardLogger` also writes the HParams tab's experiment
    (``log_run_hparams``: the run's choices against a short list of comparable metrics). A plain
    ``TensorBoardLogger`` gets the session-start summary alone, without a metric value (Lightning's logger
    writes e.g. ``hp_metric=-1``): TensorBoard then builds the experiment from every run's session and
    offers all the runs' scalars as metrics. Call it before ``fit``.
    """
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.tensorboard.summary import hparams

    for logger in trainer.loggers:
        log_run_hparams = getattr(logger, "log_run_hparams", None)  # ZeroTensorBoardLogger (a layer above)
        if callable(log_run_hparams):
            log_run_hparams(params, trainer.world_size)
        elif isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
            writer = logger.experiment._get_file_writer()
            _experiment, session_start, _end = hparams(flatten_hparams(params), {})
            writer.add_summary(session_start)
        logger.log_hyperparams(dict(params))


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: ``torch.cuda.max_memory_allocated`` on a CUDA device; otherwise the peak
    resident set size (``VmHWM`` of ``/proc/self/status``, or ``getrusage`` where there is no ``/proc``),
    which covers the whole process since it started (imports and the data loader too)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, kB elsewhere


def io_totals(swap: Any) -> dict[str, float]:
    """:data:`IO_KEYS` so far: from ``swap`` (the strategy's ``IOCounters``: swap-file bytes, the reader's and
    writer's busy seconds, the seconds waited) and this process's disk bytes (``/proc/self/io``; 0 without it)."""
    out = dict.fromkeys(IO_KEYS, 0.0)
    if swap is not None:
        out.update(read=float(swap.bytes_read), written=float(swap.bytes_written),
                   busy=float(swap.read_s + swap.write_s), wait=float(swap.wait_s))
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/io").read_text().splitlines() if ":" in line)
        out.update(disk_read=float(fields["read_bytes"]), disk_written=float(fields["write_bytes"]))
    except (OSError, KeyError, ValueError):
        pass
    return out


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def batch_counts(batch: Any) -> tuple[int, int]:
    """``(samples, tokens)`` of one micro-batch.

    samples: the first dimension of the batch's first tensor (depth first through mappings, lists
    and tuples), as Lightning infers batch sizes. tokens: the number of elements of the input ids,
    i.e. ``batch["input_ids"]`` when the batch is a mapping with that key, else the first tensor,
    *when that tensor has an integer dtype* (token ids); 0 otherwise (no tokens/s is logged then).
    Padding counts as tokens. Pass ``count_batch=`` to the monitor for another rule.
    """
    first = _first_tensor(batch)
    if first is None:
        return 0, 0
    samples = int(first.shape[0]) if first.dim() else 1
    ids = batch["input_ids"] if isinstance(batch, Mapping) and "input_ids" in batch else first
    tokens = ids.numel() if isinstance(ids, torch.Tensor) and _is_integer(ids) else 0
    return samples, int(tokens)


@dataclass(frozen=True)
class ProfilerWindow:
    """Which optimizer steps :mod:`torch.profiler` records (``torch.profiler.schedule``): skip ``wait``
    steps, warm up for ``warmup``, record ``active``; ``repeat`` such cycles (0: until the end).

    Memory is always profiled (``profile_memory=True``). Each rank writes its own trace,
    ``rank<r>.<timestamp>.pt.trace.json``, with ``tensorboard_trace_handler`` into ``<log dir>/profiler``
    (the logger's log directory, else the Trainer's ``default_root_dir``).
    """

    wait: int = 5
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = True
    with_stack: bool = False

    def __post_init__(self) -> None:
        if self.wait < 0 or self.warmup < 0 or self.active < 1 or self.repeat < 0:
            raise ValueError(f"ProfilerWindow needs wait, warmup, repeat >= 0 and active >= 1, got {self}.")

    def build(self, trace_dir: str | Path, rank: int, cuda: bool) -> torch.profiler.profile:
        """An unstarted profiler that writes this rank's traces into ``trace_dir``."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active,
                                             repeat=self.repeat),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}"),
            profile_memory=True,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
        )
