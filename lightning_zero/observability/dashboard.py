"""TensorBoard as a user reads it: :class:`ZeroTensorBoardLogger` names, groups and lays out the scalars.

What it changes against Lightning's ``TensorBoardLogger`` (docs/monitoring.md, "Reading the dashboard"):

- every scalar at the global step (:meth:`ZeroTensorBoardLogger.follow`), so curves are monotone;
- the groups TensorBoard's Time Series opens (the first two by name) are ``loss`` (``train/loss``, the
  monitor's mean over ranks, as ``loss/train``; ``val_loss`` as ``loss/val``) and ``main`` (learning
  rate, gradient norm, fp16 loss scale and skipped steps, tokens/s, samples/s); Lightning's ``epoch``
  scalar is left out (it is in the CSV and the checkpoints);
- one run per training run: a per-rank value is a tag of the run, ``time/rank<r>/step`` written as
  ``time/step_rank<r>`` (seconds) and ``memory/rank<r>/peak`` as ``memory_MiB/peak_rank<r>``: in MiB, the unit in
  the group's name, which TensorBoard shows above every memory chart (the monitor's names, in bytes, stay in the
  CSV);
- the custom-scalars layout lists only charts whose tags the run has written (no fp16 charts on an
  fp32 run), rewritten whenever a new tag appears; a per-rank chart has one line per rank;
- :meth:`ZeroTensorBoardLogger.log_run_hparams` gives the HParams tab the run's choices and a short list of
  comparable metrics (:func:`comparable_metrics`);
- ``log_config_text`` puts the whole config into the Text tab (the hparams hold the run's choices).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_zero.observability.monitoring import dashboard_layout, flatten_hparams

MIB = 2**20
MEMORY_GROUP = "memory_MiB"  # the TensorBoard group of the per-rank memory scalars: their unit in its name
# monitor / module name -> TensorBoard tag (the CSV and callback_metrics keep the monitor's names): the groups
# `loss` and `main` sort first, so they are the two that TensorBoard's Time Series opens
RENAMED: dict[str, str] = {
    "train/loss": "loss/train", "val_loss": "loss/val", "train/lr": "main/lr", "train/grad_norm": "main/grad_norm",
    "train/loss_scale": "main/loss_scale", "train/skipped_steps": "main/skipped_steps",
    "throughput/tokens_per_s": "main/tokens_per_s", "throughput/samples_per_s": "main/samples_per_s",
}
LEFT_OUT = frozenset({"epoch"})
# the hyperparameters the HParams table shows first (it shows five until more are ticked)
LEADING_HPARAMS = ("zero_stage", "offload", "precision", "optimizer", "pipeline")
_PER_RANK = re.compile(r"(time|memory)/rank(\d+)/(.+)")
_LR_GROUP = re.compile(r"train/lr_pg(\d+)")


def tensorboard_scalar(name: str, value: float) -> tuple[str, float] | None:
    """The tag and value :class:`ZeroTensorBoardLogger` writes for the metric ``name`` (``None``: left out).

    Per-rank values become tags of the one run, ``time/<key>_rank<r>`` (seconds) and ``memory_MiB/<key>_rank<r>``
    (MiB, from the monitor's bytes); the run's vital signs move to the ``main`` group."""
    if name in LEFT_OUT:
        return None
    match = _PER_RANK.fullmatch(name)
    if match:
        topic, rank, key = match.groups()
        if topic == "memory":
            return f"{MEMORY_GROUP}/{key}_rank{rank}", value / MIB
        return f"{topic}/{key}_rank{rank}", value
    match = _LR_GROUP.fullmatch(name)
    if match:
        return f"main/lr_pg{match.group(1)}", value
    return RENAMED.get(name, name), value


def tensorboard_tag(name: str) -> str:
    """The tag :class:`ZeroTensorBoardLogger` writes a metric named ``name`` as."""
    found = tensorboard_scalar(name, 0.0)
    return found[0] if found is not None else name


def comparable_metrics(world_size: int) -> list[str]:
    """The HParams tab's metric columns: the final training and validation loss, tokens/s, each rank's peak
    memory (MiB)."""
    return ["loss/train", "loss/val", "main/tokens_per_s", *(f"{MEMORY_GROUP}/peak_rank{r}" for r in range(world_size))]


class ZeroTensorBoardLogger(TensorBoardLogger):
    """A ``TensorBoardLogger`` that writes the ZeRO dashboard (module docstring); same arguments.

    Args:
        args, kwargs: those of ``lightning.pytorch.loggers.TensorBoardLogger``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tags: set[str] = set()
        self._trainer: Any = None

    def follow(self, trainer: Any) -> None:
        """Write every scalar at ``trainer.global_step`` (the optimizer steps taken), whatever step Lightning
        passes: its own axis puts a step's training metrics at ``global_step - 1`` and a validation inside
        the fit one step behind the one after it. ``ZeroStatsMonitor`` calls this when a fit starts."""
        self._trainer = trainer

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._trainer is not None:
            step = self._trainer.global_step
        main: dict[str, float] = {}
        for name, value in metrics.items():
            found = tensorboard_scalar(name, float(value))
            if found is not None:
                main[found[0]] = found[1]
        if main:
            super().log_metrics(main, step)
        if not set(main) <= self._tags:
            self._tags |= set(main)
            self.experiment.add_custom_scalars(dashboard_layout(self._tags))

    @rank_zero_only
    def log_run_hparams(self, params: Mapping[str, Any], world_size: int) -> None:
        """The HParams tab's experiment and this run's session: the hyperparameters ``params`` (nested keys
        become ``a/b``), :data:`LEADING_HPARAMS` first, against :func:`comparable_metrics` (the table
        offers those as its metric columns, not every scalar). Call it before ``fit``."""
        from tensorboard.plugins.hparams import plugin_data_pb2
        from torch.utils.tensorboard.summary import hparams

        flat = flatten_hparams(params)
        experiment, session_start, _end = hparams(flat, dict.fromkeys(comparable_metrics(world_size), 0.0))
        meta = experiment.value[0].metadata.plugin_data
        data = plugin_data_pb2.HParamsPluginData.FromString(meta.content)
        for info in data.experiment.hparam_infos:  # TensorBoard lists these first (it cannot see other runs here)
            info.differs = info.name in LEADING_HPARAMS
        meta.content = data.SerializeToString()
        writer = self.experiment._get_file_writer()
        writer.add_summary(experiment)
        writer.add_summary(session_start)

    @rank_zero_only
    def log_config_text(self, yaml_text: str) -> None:
        """The run's whole config in TensorBoard's Text tab (tag ``config``)."""
        self.experiment.add_text("config", "\n".join("    " + line for line in yaml_text.splitlines()), 0)
