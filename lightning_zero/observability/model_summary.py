"""``ZeroModelSummary``: Lightning's model summary without a column of unmeasured FLOPs."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table


class ZeroModelSummary(ModelSummary):
    """Lightning's ``ModelSummary``, without the ``FLOPs`` column and the ``Total Flops`` line when no FLOPs
    were measured (Lightning counts them only for a module with an ``example_input_array``, and prints a
    column of zeros otherwise); with measured FLOPs, Lightning's table. ``lightning-zero train`` uses it.

    Args:
        max_depth, summarize_kwargs: those of ``lightning.pytorch.callbacks.ModelSummary``.
    """

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        if total_flops:
            ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                   total_training_modes, total_flops, **summarize_kwargs)
            return
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *columns)
        table = "\n".join(line for line in table.splitlines() if not line.endswith("Total Flops"))
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + table)
