"""``ZeroModelSummary``: Lightning's model summary without a column of unmeasured FLOPs, and saying "per rank"
when a rank holds part of the model."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from typing_extensions import override

from lightning_zero.checkpoint.slices import split_dim
from lightning_zero.tensor_parallel.collectives import TPGroup


def per_rank_note(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why the summary's counts are one rank's: its tensor-parallel slices, its pipeline stage (``None``: the
    module is whole on this rank)."""
    parts = []
    if any(split_dim(p) is not None for p in pl_module.parameters()):
        sizes = {g.size for m in pl_module.modules() for g in vars(m).values() if isinstance(g, TPGroup)}
        size = f" ({max(sizes)} ranks)" if sizes else ""
        parts.append(f"the layers tensor parallelism splits{size} hold only this rank's slices")
    if getattr(trainer.strategy, "pipelined", False):
        parts.append("only this rank's pipeline stage is built")
    return f"Per rank: {'; '.join(parts)}." if parts else None


class ZeroModelSummary(ModelSummary):
    """Lightning's ``ModelSummary``, without the ``FLOPs`` column and the ``Total Flops`` line when no FLOPs
    were measured (Lightning counts them only for a module with an ``example_input_array``, and prints a
    column of zeros otherwise); with measured FLOPs, Lightning's table. Where a rank holds part of the model
    (tensor-parallel slices, a pipeline stage: :func:`per_rank_note`) its totals say "per rank", and a last
    line says why. ``lightning-zero train`` uses it.

    Args:
        max_depth, summarize_kwargs: those of ``lightning.pytorch.callbacks.ModelSummary``.
    """

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._summarize_kwargs.pop("per_rank", None)
        note = per_rank_note(trainer, pl_module)
        if note is not None:
            self._summarize_kwargs["per_rank"] = note
        super().on_fit_start(trainer, pl_module)

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  per_rank: str | None = None, **summarize_kwargs: Any) -> None:
        if total_flops and per_rank is None:
            ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                   total_training_modes, total_flops, **summarize_kwargs)
            return
        columns = [(name, values) for name, values in summary_data if name != "FLOPs" or total_flops]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *columns)
        lines = [line for line in table.splitlines() if total_flops or not line.endswith("Total Flops")]
        if per_rank is not None:
            lines = [f"{line} per rank" if line.endswith(("params", "(MB)")) else line for line in lines]
            lines.append(per_rank)
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + "\n".join(lines))
