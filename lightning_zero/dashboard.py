"""TensorBoard as a user reads it: :class:`ZeroTensorBoardLogger` names, groups and lays out the scalars.

What it changes against Lightning's ``TensorBoardLogger`` (docs/monitoring.md, "Reading the dashboard"):

- every scalar at the global step (:meth:`ZeroTensorBoardLogger.follow`), so curves are monotone;
- the losses come first: ``train/loss`` (the monitor's mean over ranks) is written as ``loss/train`` and
  ``val_loss`` as ``loss/val``, so TensorBoard's Time Series opens on the ``loss`` group; Lightning's
  ``epoch`` scalar is left out (it is in the CSV and the checkpoints);
- each rank is a run: ``time/rank<r>/step`` is written as ``time/step`` into the sub-directory
  ``rank<r>/``, so TensorBoard gives every rank its own colour and legend entry in one chart;
- the custom-scalars layout lists only charts whose tags the run has written (no fp16 charts on an
  fp32 run), rewritten whenever a new tag appears;
- ``log_config_text`` puts the whole config into the Text tab (the hparams hold the run's choices).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_zero.monitoring import dashboard_layout

# monitor / module name -> TensorBoard tag (the CSV and callback_metrics keep the monitor's names)
RENAMED: dict[str, str] = {"train/loss": "loss/train", "val_loss": "loss/val"}
LEFT_OUT = frozenset({"epoch"})
_PER_RANK = re.compile(r"(time|memory)/rank(\d+)/(.+)")


def tensorboard_tag(name: str) -> str:
    """The tag :class:`ZeroTensorBoardLogger` writes a metric named ``name`` as (per-rank ones: in ``rank<r>/``)."""
    match = _PER_RANK.fullmatch(name)
    return f"{match.group(1)}/{match.group(3)}" if match else RENAMED.get(name, name)


class ZeroTensorBoardLogger(TensorBoardLogger):
    """A ``TensorBoardLogger`` that writes the ZeRO dashboard (module docstring); same arguments.

    Args:
        args, kwargs: those of ``lightning.pytorch.loggers.TensorBoardLogger``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rank_writers: dict[int, Any] = {}
        self._tags: set[str] = set()
        self._trainer: Any = None

    def follow(self, trainer: Any) -> None:
        """Write every scalar at ``trainer.global_step`` (the optimizer steps taken), whatever step Lightning
        passes: its own axis puts a step's training metrics at ``global_step - 1`` and a validation inside
        the fit one step behind the one after it. ``ZeroStatsMonitor`` calls this when a fit starts."""
        self._trainer = trainer

    def _rank_writer(self, rank: int) -> Any:
        if rank not in self._rank_writers:
            from torch.utils.tensorboard import SummaryWriter

            self._rank_writers[rank] = SummaryWriter(log_dir=os.path.join(self.log_dir, f"rank{rank}"))
        return self._rank_writers[rank]

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._trainer is not None:
            step = self._trainer.global_step
        main: dict[str, float] = {}
        for name, value in metrics.items():
            match = _PER_RANK.fullmatch(name)
            if match:
                writer = self._rank_writer(int(match.group(2)))
                writer.add_scalar(tensorboard_tag(name), float(value), step)
                self._tags.add(tensorboard_tag(name))
            elif name not in LEFT_OUT:
                main[tensorboard_tag(name)] = value
        if main:
            super().log_metrics(main, step)
        if not set(main) <= self._tags:
            self._tags |= set(main)
            self.experiment.add_custom_scalars(dashboard_layout(self._tags))

    @rank_zero_only
    def log_config_text(self, yaml_text: str) -> None:
        """The run's whole config in TensorBoard's Text tab (tag ``config``)."""
        self.experiment.add_text("config", "\n".join("    " + line for line in yaml_text.splitlines()), 0)

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        for writer in self._rank_writers.values():
            writer.flush()
            writer.close()
        self._rank_writers.clear()
